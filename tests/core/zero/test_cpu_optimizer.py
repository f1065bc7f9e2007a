"""torch Adam/AdamW rebuilt as DeepSpeed's CPU Adam: same groups and hyperparameters, same numbers."""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from lightspeed.core.errors import UnsupportedOffloadOptimizerError
from lightspeed.core.zero.cpu_optimizer import describe_conversion, to_deepspeed_cpu_adam


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

    from lightspeed.core.zero.cpu_optimizer import retarget_lr_scheduler

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


def test_adagrad_becomes_deepspeed_cpu_adagrad_and_matches_torch() -> None:
    from lightspeed.core.zero.cpu_optimizer import to_deepspeed_cpu_optimizer

    reference_params, converted_params = _params(), _params()
    groups = lambda ps: [  # noqa: E731
        {"params": [ps[0]], "lr": 5e-2, "weight_decay": 0.1},
        {"params": [ps[1]], "lr": 1e-2},
    ]
    reference = torch.optim.Adagrad(groups(reference_params), lr=3e-2, eps=1e-8)
    original = torch.optim.Adagrad(groups(converted_params), lr=3e-2, eps=1e-8)
    converted = to_deepspeed_cpu_optimizer(original)
    assert type(converted).__name__ == "DeepSpeedCPUAdagrad"
    assert [g["lr"] for g in converted.param_groups] == [5e-2, 1e-2]
    _run(reference, reference_params)
    _run(converted, converted_params)
    for expected, actual in zip(reference_params, converted_params, strict=False):
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
    line = describe_conversion(original, converted)
    assert line.startswith("Optimizer offload: `Adagrad` runs as DeepSpeed's `DeepSpeedCPUAdagrad` (L2 weight decay)")


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.AdamW(ps, amsgrad=True),  # CPU Adam has no amsgrad: torch's own runs
        lambda ps: torch.optim.Adagrad(ps, lr_decay=0.1),  # CPU Adagrad has no lr decay
        lambda ps: torch.optim.RMSprop(ps),
    ],
    ids=["sgd", "amsgrad", "adagrad_lr_decay", "rmsprop"],
)
def test_other_torch_optimizers_run_as_they_are(make) -> None:
    from lightspeed.core.zero.cpu_optimizer import describe_unfused, runs_unfused, to_deepspeed_cpu_optimizer

    optimizer = make(_params())
    assert to_deepspeed_cpu_optimizer(optimizer) is optimizer
    assert runs_unfused(optimizer)
    assert describe_unfused(optimizer).startswith(
        f"Optimizer offload: `{type(optimizer).__name__}` has no fused DeepSpeed CPU implementation with these "
        "settings; it runs unfused on the CPU"
    )


def test_adam_is_still_converted_by_the_dispatcher() -> None:
    from lightspeed.core.zero.cpu_optimizer import runs_unfused, to_deepspeed_cpu_optimizer

    converted = to_deepspeed_cpu_optimizer(torch.optim.AdamW(_params()))
    assert type(converted).__name__ == "DeepSpeedCPUAdam" and not runs_unfused(converted)


def test_lbfgs_cannot_be_offloaded() -> None:
    from lightspeed.core.zero.cpu_optimizer import to_deepspeed_cpu_optimizer

    with pytest.raises(
        UnsupportedOffloadOptimizerError,
        match=r"^Optimizer offload cannot run `LBFGS`: `LBFGS` needs a closure .* Use an optimizer without a closure "
        r"\(e\.g\. `torch\.optim\.AdamW`\) or train LBFGS without ZeRO \(e\.g\. `strategy='ddp'`\)\.$",
    ):
        to_deepspeed_cpu_optimizer(torch.optim.LBFGS(_params()))


def test_fresh_adagrad_is_not_taken_for_a_stepped_one() -> None:
    from lightspeed.core.zero.cpu_optimizer import to_deepspeed_cpu_adagrad

    params = _params()
    fresh = torch.optim.Adagrad(params)  # torch creates its state (at step 0) in __init__
    assert fresh.state
    assert type(to_deepspeed_cpu_adagrad(fresh)).__name__ == "DeepSpeedCPUAdagrad"
    stepped = torch.optim.Adagrad(params)
    _run(stepped, params, steps=1)
    with pytest.raises(UnsupportedOffloadOptimizerError, match="already holds state"):
        to_deepspeed_cpu_adagrad(stepped)
