"""Driving a DeepSpeed engine's accumulation window from outside: which micro-batch closes it, how many micro-batches
it holds, the exact window factor and a per-step clipping norm, applied where ZeRO keeps its gradients.

Shared by the Trainer's exact accumulation (:mod:`lightspeed.strategies.exact_accumulation`) and Fabric's
(:mod:`lightspeed.fabric.exact_accumulation`). DeepSpeed only; no Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightspeed.core.accumulation.exact import scale_gradients, scale_tensors
from lightspeed.core.zero.stale_gradients import complete_window_gradients

__all__ = [
    "clip_norm_at_step",
    "scale_deepspeed_gradients_at_step",
    "scale_reduced_gradients",
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
    """Make the engine's next optimizer step use its accumulated gradients multiplied by ``factor``; call it after
    the window's last backward.

    Where ZeRO keeps the reduced gradients in buffers lightspeed can reach (:func:`scale_reduced_gradients`), they
    are multiplied there at once, so whatever reads them before the step (``safe_get_full_grad`` in a hook, gradient
    norm logging, clipping) sees the real big-batch gradient. Elsewhere (fp16 with loss scaling, whose stored
    gradients a factor above 1 could overflow; ZeRO-3 with its optimizer states on NVMe; DeepSpeed's stage-0
    mixed-precision optimizers) the optimizer's loss scale is overridden with ``scale / factor`` for the step, which
    multiplies the gradients by ``factor`` right before clipping and the update. Without ZeRO (plain fp32 optimizer)
    the gradients are in ``param.grad``. Returns a function that restores the optimizer's own loss scale; call it
    after ``engine.step()``.
    """
    optimizer = engine.optimizer
    if factor == 1.0:
        return lambda: None
    if not engine.fp16_enabled() and scale_reduced_gradients(optimizer, factor):
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


def scale_reduced_gradients(optimizer: Any, factor: float) -> bool:
    """Multiply in place the gradients a ZeRO-1/2/3 ``optimizer`` holds for its next step (after the window's last
    backward: reduced, partitioned and, under optimizer offload, copied to the CPU with their norms taken, the window
    completed first by :func:`~lightspeed.core.zero.stale_gradients.complete_window_gradients`), and those norms;
    returns False, scaling nothing, where the gradients are not reachable here (other optimizers; ZeRO-3 with its
    optimizer states swapped to NVMe).

    Where each ZeRO optimizer of DeepSpeed 0.19 keeps them (``deepspeed/runtime/zero/``):

    * ZeRO-1/2: ``averaged_gradients[group]``, one tensor per parameter fragment of the partition (or a buffer group
      over one flat partition); with offload, the flat ``single_partition_of_fp32_groups[group].grad`` and the
      per-parameter norms the clipping reads (``norm_for_param_grads``);
    * ZeRO-3: one flat ``grad_partitions_flat_buffer`` that every parameter's partition views; with offload, the flat
      ``fp32_partitioned_groups_flat[group].grad`` and ``norm_for_param_grads``.
    """
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(optimizer, (DeepSpeedZeroOptimizer_Stage3, DeepSpeedZeroOptimizer)):
        complete_window_gradients(optimizer)  # what the step would complete later must be scaled too
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        if optimizer.offload_optimizer:
            if optimizer.swap_optimizer:
                return False
            _scale_flat_gradients(optimizer.fp32_partitioned_groups_flat, factor)
            _scale_norms(optimizer.norm_for_param_grads, factor)
        else:
            optimizer.grad_partitions_flat_buffer.mul_(factor)
        return True
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        if optimizer.cpu_offload:
            _scale_flat_gradients(optimizer.single_partition_of_fp32_groups, factor)
            _scale_norms(optimizer.norm_for_param_grads, factor)
            return True
        for fragments in optimizer.averaged_gradients.values():
            if fragments is None:
                continue
            flat = getattr(fragments, "flat_partition", None)  # one buffer behind every fragment: scaled once
            if flat is not None:
                flat.mul_(factor)
            else:
                scale_tensors([fragment for fragment in fragments if fragment is not None], factor)
        return True
    return False


def _scale_flat_gradients(flat_groups: list[Any], factor: float) -> None:
    scale_tensors([flat.grad for flat in flat_groups if flat.grad is not None], factor)


def _scale_norms(norms: dict[Any, Any], factor: float) -> None:
    for key, norm in norms.items():
        norms[key] = norm * abs(factor)


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
