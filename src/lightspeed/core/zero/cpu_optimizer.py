"""Running a user's torch optimizer on the CPU when ZeRO offloads the optimizer there.

DeepSpeed has fused CPU implementations of Adam/AdamW and Adagrad. Users write ``torch.optim.AdamW(...)`` in
``configure_optimizers``; we rebuild it as ``DeepSpeedCPUAdam`` (``Adagrad``: ``DeepSpeedCPUAdagrad``) with the same
parameter groups and hyperparameters, so nothing in their module changes. Any other torch optimizer runs as it is
on the offloaded fp32 weights (DeepSpeed calls its ``step()`` on the CPU partitions; correct, only unfused), except
the few that cannot work there at all (:data:`_NOT_OFFLOADABLE`).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from lightspeed.core.errors import UnsupportedOffloadOptimizerError

#: hyperparameter keys carried over from each torch param group
_ADAM_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


#: DeepSpeed's CPU optimizers; under offload DeepSpeed accepts only the ones in ``_FORCED_BY_DEEPSPEED`` unless
#: ``zero_force_ds_cpu_optimizer`` is false
_DEEPSPEED_CPU_OPTIMIZERS = frozenset({"DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion"})
_FORCED_BY_DEEPSPEED = frozenset({"DeepSpeedCPUAdam", "DeepSpeedCPULion"})


def is_deepspeed_cpu_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """True for DeepSpeed's own CPU optimizers (CPU Adam, Adagrad, Lion), which need no conversion."""
    return type(optimizer).__name__ in _DEEPSPEED_CPU_OPTIMIZERS


#: torch optimizers that cannot run on ZeRO's offloaded partitions at all -> why, and what to use instead
_NOT_OFFLOADABLE: dict[type[torch.optim.Optimizer], str] = {
    torch.optim.LBFGS: (
        "`LBFGS` needs a closure that re-evaluates the loss at every step, and DeepSpeed steps the optimizer without "
        "one; its state (the curvature history) also spans all parameters of a group instead of being per-parameter "
        "tensors that ZeRO can partition. Use an optimizer without a closure (e.g. `torch.optim.AdamW`) or train "
        "LBFGS without ZeRO (e.g. `strategy='ddp'`)."
    ),
    torch.optim.SparseAdam: (
        "`SparseAdam` needs sparse gradients, but ZeRO reduces and offloads dense gradient partitions. Use "
        "`torch.optim.Adam`/`AdamW` (run as DeepSpeed's CPU Adam) or a strategy without optimizer offload."
    ),
}


def _adam_convertible(optimizer: torch.optim.Optimizer) -> bool:
    """Plain torch Adam/AdamW that DeepSpeed's CPU Adam computes exactly (no amsgrad/maximize/...)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    return not any(group.get("amsgrad") or group.get("maximize") for group in optimizer.param_groups)


def _adagrad_convertible(optimizer: torch.optim.Optimizer) -> bool:
    """Plain torch Adagrad that DeepSpeed's CPU Adagrad computes exactly (its kernel has no lr decay, no initial
    accumulator value and no maximize)."""
    if type(optimizer) is not torch.optim.Adagrad:
        return False
    return not any(
        group.get("lr_decay", 0) or group.get("initial_accumulator_value", 0) or group.get("maximize")
        for group in optimizer.param_groups
    )


def _has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` took a step (torch's Adagrad creates its state, at step 0, in ``__init__``)."""
    for state in optimizer.state.values():
        step = state.get("step", 1) if isinstance(state, dict) else 1
        if float(step) > 0:
            return True
    return False


def _refuse_stepped(optimizer: torch.optim.Optimizer, target: str) -> None:
    if _has_stepped(optimizer):
        raise UnsupportedOffloadOptimizerError(
            f"`{type(optimizer).__name__}` already holds state; the conversion to DeepSpeed's {target} happens "
            "before the first step. Create the optimizer in `configure_optimizers` without stepping it."
        )


def to_deepspeed_cpu_optimizer(
    optimizer: torch.optim.Optimizer, fp32_optimizer_states: bool = True
) -> torch.optim.Optimizer:
    """The optimizer to run under optimizer offload in place of ``optimizer``.

    ``Adam``/``AdamW`` become ``DeepSpeedCPUAdam`` (with bf16 moments where ``fp32_optimizer_states`` is False: the
    strategies' ``bf16_optimizer_states``) and ``Adagrad`` becomes ``DeepSpeedCPUAdagrad`` when DeepSpeed's kernels
    compute exactly what torch would; DeepSpeed's own CPU optimizers and every other torch optimizer are returned
    unchanged (see :func:`runs_unfused`). Optimizers that cannot run on offloaded partitions raise
    :class:`UnsupportedOffloadOptimizerError` naming what to use.
    """
    if is_deepspeed_cpu_optimizer(optimizer):
        return optimizer
    for kind, why in _NOT_OFFLOADABLE.items():
        if isinstance(optimizer, kind):
            raise UnsupportedOffloadOptimizerError(f"Optimizer offload cannot run `{type(optimizer).__name__}`: {why}")
    if _adam_convertible(optimizer):
        return to_deepspeed_cpu_adam(optimizer, fp32_optimizer_states)
    if _adagrad_convertible(optimizer):
        return to_deepspeed_cpu_adagrad(optimizer)
    return optimizer


def prepare_offloaded_optimizer(
    optimizer: torch.optim.Optimizer, config: dict[str, Any]
) -> tuple[torch.optim.Optimizer, str | None]:
    """The optimizer an optimizer-offloading DeepSpeed config runs, and the one log line saying what changed.

    Converts through :func:`to_deepspeed_cpu_optimizer`; for an optimizer that runs unfused, sets
    ``zero_force_ds_cpu_optimizer: false`` in ``config`` (unless the user set it), without which DeepSpeed refuses
    any optimizer but its own CPU ones under offload. The caller retargets its LR scheduler when the optimizer
    changed (:func:`retarget_lr_scheduler`).
    """
    bf16_states = bool((config.get("bf16") or {}).get("bf16_optimizer_states"))
    converted = to_deepspeed_cpu_optimizer(optimizer, fp32_optimizer_states=not bf16_states)
    message = None
    if converted is not optimizer:
        message = describe_conversion(optimizer, converted)
    elif runs_unfused(optimizer):
        message = describe_unfused(optimizer)
    if type(converted).__name__ not in _FORCED_BY_DEEPSPEED:
        config.setdefault("zero_force_ds_cpu_optimizer", False)
    return converted, message


def runs_unfused(optimizer: torch.optim.Optimizer) -> bool:
    """True when offload runs ``optimizer`` (a torch optimizer kept as it is) on the CPU without a fused kernel."""
    return not is_deepspeed_cpu_optimizer(optimizer)


def describe_unfused(optimizer: torch.optim.Optimizer) -> str:
    """The one log line saying that a torch optimizer runs as it is on the offloaded weights."""
    return (
        f"Optimizer offload: `{type(optimizer).__name__}` has no fused DeepSpeed CPU implementation with these "
        "settings; it runs unfused on the CPU on the offloaded fp32 weights (correct, but slower than DeepSpeed's "
        "CPU Adam/Adagrad). Use `torch.optim.AdamW` or `torch.optim.Adagrad` for the fused kernels."
    )


def to_deepspeed_cpu_adagrad(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Return a ``DeepSpeedCPUAdagrad`` equivalent to a plain ``torch.optim.Adagrad`` (no ``lr_decay``, no
    ``initial_accumulator_value``, no ``maximize``); param groups keep their hyperparameters and extra keys."""
    if is_deepspeed_cpu_optimizer(optimizer):
        return optimizer
    if not _adagrad_convertible(optimizer):
        raise UnsupportedOffloadOptimizerError(
            f"`{type(optimizer).__name__}` cannot run as DeepSpeed's CPU Adagrad: only `torch.optim.Adagrad` without "
            "`lr_decay`, `initial_accumulator_value` and `maximize` can."
        )
    _refuse_stepped(optimizer, "CPU Adagrad")

    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

    groups: list[dict[str, Any]] = [dict(group) for group in optimizer.param_groups]
    defaults = optimizer.defaults
    return DeepSpeedCPUAdagrad(groups, lr=defaults["lr"], eps=defaults["eps"], weight_decay=defaults["weight_decay"])


def to_deepspeed_cpu_adam(
    optimizer: torch.optim.Optimizer, fp32_optimizer_states: bool = True
) -> torch.optim.Optimizer:
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
    _refuse_stepped(optimizer, "CPU Adam")

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
        fp32_optimizer_states=fp32_optimizer_states,
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
    if type(converted).__name__ == "DeepSpeedCPUAdagrad":
        mode = "L2 weight decay"
    else:
        mode = "decoupled weight decay" if getattr(converted, "adam_w_mode", True) else "L2 weight decay"
    return (
        f"Optimizer offload: `{type(original).__name__}` runs as DeepSpeed's `{type(converted).__name__}` "
        f"({mode}) with param groups [{groups}]"
    )
