"""Driving a DeepSpeed engine's accumulation window from outside: which micro-batch closes it, how many micro-batches
it holds, the exact window factor and a per-step clipping norm, applied where ZeRO keeps its gradients.

Shared by the Trainer's exact accumulation (:mod:`lightspeed.strategies.exact_accumulation`) and Fabric's
(:mod:`lightspeed.fabric.exact_accumulation`). DeepSpeed only; no Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightspeed.core.accumulation.exact import scale_gradients

__all__ = [
    "clip_norm_at_step",
    "scale_deepspeed_gradients_at_step",
    "set_deepspeed_accumulation_steps",
    "set_deepspeed_boundary",
]


def set_deepspeed_boundary(engine: Any, is_boundary: bool) -> None:
    """Tell a DeepSpeed engine whether the next backward closes the accumulation window.

    Replaces the engine's own micro-step counter (which assumes every window has ``gradient_accumulation_steps``
    micro-batches and so drifts after a short window). With ``False`` ZeRO-0/1 keep gradients local (no reduction);
    ZeRO-2/3 reduce-scatter every micro-batch by design. ``engine.step()`` updates only after a ``True`` backward.
    """
    engine.set_gradient_accumulation_boundary(is_boundary)


def set_deepspeed_accumulation_steps(engine: Any, steps: int) -> None:
    """Make an already built engine (and its ZeRO optimizer) accumulate ``steps`` micro-batches per window.

    DeepSpeed reads the count from its config at ``deepspeed.initialize``; ZeRO-2 with CPU offload keeps its own
    accumulation buffers only when the count is above 1, so a window driven through :func:`set_deepspeed_boundary`
    must be announced here first. The batch-size bookkeeping (``train_batch_size``) follows.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a whole number >= 1, got {steps!r}.")
    if engine.gradient_accumulation_steps() == steps:
        return
    config = engine._config
    config.gradient_accumulation_steps = steps
    config.train_batch_size = engine.train_micro_batch_size_per_gpu() * steps * engine.dp_world_size
    optimizer = engine.optimizer
    if optimizer is not None and hasattr(optimizer, "gradient_accumulation_steps"):
        optimizer.gradient_accumulation_steps = steps


def scale_deepspeed_gradients_at_step(engine: Any, factor: float) -> Callable[[], None]:
    """Make the engine's next optimizer step use its accumulated gradients multiplied by ``factor``.

    ZeRO-1/2/3 keep reduced gradients in partitions that only their optimizer can see, and every one of them divides
    the gradients by its loss scale right before clipping and the update; overriding that scale with
    ``scale / factor`` multiplies the gradients by ``factor`` exactly there, so clipping and the reported gradient
    norm see the real big-batch gradient. Without ZeRO (plain fp32 optimizer) the gradients are in ``param.grad``.
    Returns a function that restores the optimizer's own loss scale; call it after ``engine.step()``.
    """
    optimizer = engine.optimizer
    if factor == 1.0:
        return lambda: None
    if hasattr(optimizer, "override_loss_scale") and hasattr(optimizer, "external_loss_scale"):
        saved = (optimizer.custom_loss_scaler, optimizer.external_loss_scale)
        optimizer.override_loss_scale(optimizer.loss_scale / factor)

        def restore() -> None:
            optimizer.custom_loss_scaler, optimizer.external_loss_scale = saved

        return restore
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer

    if not isinstance(optimizer, DeepSpeedOptimizer):  # no ZeRO, fp32: DeepSpeed steps the plain optimizer
        scale_gradients((p for group in optimizer.param_groups for p in group["params"]), factor)
        return lambda: None
    raise RuntimeError(
        f"Exact gradient accumulation cannot rescale gradients inside DeepSpeed's {type(optimizer).__name__} (used "
        f"for ZeRO stage 0 with bf16/fp16, or ZeRO-1 with bf16 and fp32 gradient accumulation). Use ZeRO stage 1, 2 "
        f"or 3 with their default data types."
    )


def clip_norm_at_step(engine: Any, max_norm: float) -> Callable[[], None]:
    """Make the engine's next ``step()`` clip the gradient norm to ``max_norm`` (DeepSpeed clips inside the step,
    where the partitioned gradients are); returns a function restoring the configured clipping afterwards."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}.")
    config = engine._config
    optimizer = engine.optimizer
    saved_config = config.gradient_clipping
    has_clip = optimizer is not None and hasattr(optimizer, "clip_grad")
    saved_optimizer = optimizer.clip_grad if has_clip else None
    config.gradient_clipping = float(max_norm)  # stage 0: the engine clips before the plain optimizer's step
    if has_clip:
        optimizer.clip_grad = float(max_norm)  # ZeRO-1/2/3: the optimizer clips its partitions

    def restore() -> None:
        config.gradient_clipping = saved_config
        if has_clip:
            optimizer.clip_grad = saved_optimizer

    return restore
