"""Running a user's torch Adam/AdamW as DeepSpeed's CPU Adam when ZeRO offloads the optimizer to the CPU.

DeepSpeed refuses (or runs slowly) a torch optimizer whose states live on the CPU. Users write
``torch.optim.AdamW(...)`` in ``configure_optimizers``; we rebuild it as ``DeepSpeedCPUAdam`` with the same
parameter groups and hyperparameters, so nothing in their module changes.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

#: hyperparameter keys carried over from each torch param group
_ADAM_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


class UnsupportedOffloadOptimizerError(TypeError):
    """The optimizer has no CPU implementation in DeepSpeed."""


def is_deepspeed_cpu_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """True for DeepSpeed's own CPU optimizers (CPU Adam, Adagrad, Lion), which need no conversion."""
    return type(optimizer).__name__ in {"DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion"}


def to_deepspeed_cpu_adam(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Return a ``DeepSpeedCPUAdam`` equivalent to ``optimizer`` (``torch.optim.Adam`` or ``AdamW``).

    ``AdamW`` maps to decoupled weight decay (``adamw_mode=True``), ``Adam`` to L2 weight decay. Param groups keep
    their own hyperparameters and any extra keys (schedulers store ``initial_lr`` there).
    """
    if is_deepspeed_cpu_optimizer(optimizer):
        return optimizer
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise UnsupportedOffloadOptimizerError(
            f"Optimizer offload runs the optimizer on the CPU, and `{type(optimizer).__name__}` has no DeepSpeed CPU "
            "implementation. Return `torch.optim.Adam` or `torch.optim.AdamW` (converted to DeepSpeed's CPU Adam "
            "automatically) or `deepspeed.ops.adam.DeepSpeedCPUAdam` from `configure_optimizers`, or use a strategy "
            "without optimizer offload (e.g. `zero2` or `zero3`)."
        )
    for index, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise UnsupportedOffloadOptimizerError(
                    f"`{type(optimizer).__name__}({flag}=True)` (param group {index}) is not supported by DeepSpeed's "
                    f"CPU Adam, which optimizer offload uses. Remove `{flag}=True` or disable optimizer offload."
                )
    if optimizer.state:
        raise UnsupportedOffloadOptimizerError(
            f"`{type(optimizer).__name__}` already holds state; the conversion to DeepSpeed's CPU Adam happens before "
            "the first step. Create the optimizer in `configure_optimizers` without stepping it."
        )

    from deepspeed.ops.adam import DeepSpeedCPUAdam

    groups: list[dict[str, Any]] = [dict(group) for group in optimizer.param_groups]
    defaults = optimizer.defaults
    converted = DeepSpeedCPUAdam(
        groups,
        lr=defaults["lr"],
        betas=defaults["betas"],
        eps=defaults["eps"],
        weight_decay=defaults["weight_decay"],
        adamw_mode=isinstance(optimizer, torch.optim.AdamW),
    )
    return converted


def retarget_lr_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point an LR scheduler created for the original optimizer at its converted replacement.

    The converted optimizer carries the same param groups (with the scheduler's ``initial_lr``), so only the reference
    changes. torch's schedulers also wrap ``optimizer.step`` to check the call order; the replacement gets the same
    marker, otherwise every run would warn that ``optimizer.step()`` was overridden.
    """
    scheduler.optimizer = optimizer
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return
    optimizer_ref = weakref.ref(optimizer)

    @functools.wraps(step)
    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        owner = optimizer_ref()
        if owner is not None:
            owner._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked_step  # type: ignore[method-assign]


def describe_conversion(original: torch.optim.Optimizer, converted: torch.optim.Optimizer) -> str:
    """One log line saying what ran as what, with the hyperparameters of each group."""
    groups = "; ".join(
        ", ".join(f"{key}={group[key]}" for key in _ADAM_GROUP_KEYS if key in group)
        + f", params={len(group['params'])}"
        for group in converted.param_groups
    )
    mode = "decoupled weight decay" if getattr(converted, "adam_w_mode", True) else "L2 weight decay"
    return (
        f"Optimizer offload: `{type(original).__name__}` runs as DeepSpeed's `{type(converted).__name__}` "
        f"({mode}) with param groups [{groups}]"
    )
