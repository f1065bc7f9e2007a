"""DeepSpeed's CPU Adam continues a resumed run with the bias correction the uninterrupted run had, to the bit.

Its C++ optimizer keeps ``beta1 ** step`` and ``beta2 ** step`` as running products, multiplied once per step; a
fresh optimizer resumed at step ``k`` computes them with ``pow`` instead, which rounds differently, so every update
after a resume under optimizer offload differed from the uninterrupted run's in the last bits (3e-8 after two steps
in fp32, one bf16 unit in the last place of small weights with bf16 master weights). :func:`replay_cpu_adam_steps`
(after every ``engine.load_checkpoint``) runs the C++ optimizer's step counter through the restored steps on empty
tensors, which changes nothing else, so the products are the uninterrupted run's. Parameters with fewer steps than
the others (skipped by some steps) are replayed with the most steps, as the products' order cannot be recovered.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["replay_cpu_adam_steps", "replay_cpu_adam_steps_after_loads"]


def replay_cpu_adam_steps(optimizer: torch.optim.Optimizer) -> None:
    """Bring DeepSpeed's CPU Adam's C++ step products to its restored step count (nothing for other optimizers)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if type(optimizer) is not DeepSpeedCPUAdam:  # a subclass (ZenFlow's) steps its own way
        return
    adam: Any = optimizer  # its C++ handle and id are untyped
    steps = [int(state["step"]) for state in optimizer.state.values() if "step" in state]
    empty = torch.empty(0)
    for step in range(1, max(steps, default=0) + 1):
        for group in optimizer.param_groups:
            beta1, beta2 = group["betas"]
            adam.ds_opt_adam.adam_update(
                adam.opt_id, step, group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                group["bias_correction"], empty, empty, empty, empty,
            )  # fmt: skip


def replay_cpu_adam_steps_after_loads(engine: Any, inner: torch.optim.Optimizer) -> None:
    """After every ``engine.load_checkpoint``, :func:`replay_cpu_adam_steps` on ``inner``, the optimizer that steps
    inside the engine's ZeRO optimizer."""
    load = engine.load_checkpoint

    @functools.wraps(load)  # its signature stays readable (unused_parameters binds the arguments)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        loaded = load(*args, **kwargs)
        replay_cpu_adam_steps(inner)
        return loaded

    engine.load_checkpoint = load_checkpoint
