"""The inner optimizer's state after a resume is the uninterrupted run's, in one process: DeepSpeed's CPU Adam
continues with the uninterrupted run's bias-correction products (a fresh one resumed at step k recomputes them with
``pow``), and a state saved in another dtype than its parameter's comes back in it (torch's ``load_state_dict`` casts
it)."""

from __future__ import annotations

import pytest
import torch

from lightspeed.core.zero.cpu_adam_steps import replay_cpu_adam_steps
from lightspeed.core.zero.state_dtypes import keep_saved_state_dtypes

STEPS, RESUME_AT = 6, 2  # the first resumed step is 3, where beta2 ** 3 by pow and by products differ (float32)


def adam_run(replay: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU Adam for STEPS steps uninterrupted, and saved at RESUME_AT then continued by a new optimizer (the C++
    products replayed or not): both final weights."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(4096, generator=generator) for _ in range(STEPS)]
    start = torch.randn(4096, generator=generator)

    def steps(optimizer: torch.optim.Optimizer, weight: torch.nn.Parameter, which: range) -> None:
        for step in which:
            weight.grad = grads[step].clone()
            optimizer.step()

    straight = torch.nn.Parameter(start.clone())
    steps(DeepSpeedCPUAdam([straight], lr=1e-2), straight, range(STEPS))
    first = torch.nn.Parameter(start.clone())
    optimizer = DeepSpeedCPUAdam([first], lr=1e-2)
    steps(optimizer, first, range(RESUME_AT))
    resumed = torch.nn.Parameter(first.detach().clone())
    continued = DeepSpeedCPUAdam([resumed], lr=1e-2)
    continued.load_state_dict(optimizer.state_dict())
    if replay:
        replay_cpu_adam_steps(continued)
    steps(continued, resumed, range(RESUME_AT, STEPS))
    return straight.detach(), resumed.detach()


def test_cpu_adam_resumed_with_its_steps_replayed_is_the_uninterrupted_run_to_the_bit() -> None:
    straight, resumed = adam_run(replay=True)
    assert torch.equal(straight, resumed)
    straight, resumed = adam_run(replay=False)  # what DeepSpeed alone gives: pow() rounds otherwise
    assert not torch.equal(straight, resumed) and torch.allclose(straight, resumed, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kept", [True, False])
def test_a_state_saved_in_another_dtype_than_its_parameter_comes_back_in_it(kept: bool) -> None:
    weight = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    moment = torch.full((8,), 1 + 2**-12, dtype=torch.float32)  # not a bf16 number
    saved = {"state": {0: {"moment": moment}}, "param_groups": [{**optimizer.param_groups[0], "params": [0]}]}
    if kept:
        keep_saved_state_dtypes(optimizer)
    optimizer.load_state_dict(saved)
    restored = optimizer.state[weight]["moment"]
    if kept:
        assert restored.dtype == torch.float32 and torch.equal(restored, moment)
    else:  # torch's own cast, which DeepSpeed's load relies on
        assert restored.dtype == torch.bfloat16 and not torch.equal(restored.float(), moment)
