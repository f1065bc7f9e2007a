"""torch Adam/AdamW rebuilt as DeepSpeed's CPU Adam: same groups and hyperparameters, same numbers."""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from lightspeed.core.cpu_optimizer import UnsupportedOffloadOptimizerError, describe_conversion, to_deepspeed_cpu_adam


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(7, 5, generator=gen)), torch.nn.Parameter(torch.randn(5, generator=gen))]


def _run(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int = 5) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()


@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam])
def test_conversion_keeps_groups_and_matches_torch(kind) -> None:
    reference_params, converted_params = _params(), _params()
    groups = lambda ps: [  # noqa: E731
        {"params": [ps[0]], "lr": 1e-2, "weight_decay": 0.1},
        {"params": [ps[1]], "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.95)},
    ]
    reference = kind(groups(reference_params), lr=1e-3, eps=1e-7)
    original = kind(groups(converted_params), lr=1e-3, eps=1e-7)
    converted = to_deepspeed_cpu_adam(original)
    assert type(converted).__name__ == "DeepSpeedCPUAdam"
    assert converted.adam_w_mode is (kind is torch.optim.AdamW)
    for before, after in zip(original.param_groups, converted.param_groups, strict=False):
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert after[key] == before[key]
        assert after["params"] == before["params"]
    _run(reference, reference_params)
    _run(converted, converted_params)
    for expected, actual in zip(reference_params, converted_params, strict=False):
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
    line = describe_conversion(original, converted)
    assert line.startswith(f"Optimizer offload: `{kind.__name__}` runs as DeepSpeed's `DeepSpeedCPUAdam`")
    assert "lr=0.003" in line and "betas=(0.8, 0.95)" in line


def test_scheduler_keys_in_groups_survive() -> None:
    params = _params()
    original = torch.optim.AdamW(params, lr=1e-2)
    torch.optim.lr_scheduler.StepLR(original, step_size=1)  # writes initial_lr into the groups
    converted = to_deepspeed_cpu_adam(original)
    assert converted.param_groups[0]["initial_lr"] == 1e-2


def test_optimizer_without_cpu_implementation() -> None:
    with pytest.raises(UnsupportedOffloadOptimizerError, match=r"`SGD` has no DeepSpeed CPU implementation"):
        to_deepspeed_cpu_adam(torch.optim.SGD(_params(), lr=0.1))


def test_amsgrad_is_refused() -> None:
    with pytest.raises(UnsupportedOffloadOptimizerError, match=r"`AdamW\(amsgrad=True\)` \(param group 0\)"):
        to_deepspeed_cpu_adam(torch.optim.AdamW(_params(), amsgrad=True))


def test_stepped_optimizer_is_refused() -> None:
    params = _params()
    optimizer = torch.optim.Adam(params)
    _run(optimizer, params, steps=1)
    with pytest.raises(UnsupportedOffloadOptimizerError, match="already holds state"):
        to_deepspeed_cpu_adam(optimizer)


def test_deepspeed_optimizer_passes_through() -> None:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    optimizer = DeepSpeedCPUAdam(_params(), lr=1e-3)
    assert to_deepspeed_cpu_adam(optimizer) is optimizer


def test_scheduler_follows_the_converted_optimizer_without_warnings() -> None:
    import warnings

    from lightspeed.core.cpu_optimizer import retarget_lr_scheduler

    params = _params()
    original = torch.optim.AdamW(params, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(original, step_size=1, gamma=0.5)
    converted = to_deepspeed_cpu_adam(original)
    retarget_lr_scheduler(scheduler, converted)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns if optimizer.step looks overridden or was not called first
        _run(converted, params, steps=1)
        scheduler.step()
    assert converted.param_groups[0]["lr"] == pytest.approx(5e-3)
    assert original.param_groups[0]["lr"] == pytest.approx(1e-2)  # the original is no longer driven
