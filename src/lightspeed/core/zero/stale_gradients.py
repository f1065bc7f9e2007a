"""No ZeRO step applies a gradient left from an earlier step.

A parameter that no rank used in a step (a layer skipped on some steps, a head chosen by the step, experts no token
reached) has no gradient in one plain process, and its optimizer leaves it alone. ZeRO keeps each rank's gradient
partition in buffers it fills only for the parameters it reduced, and DeepSpeed 0.19 does not clear them between
steps everywhere (``deepspeed/runtime/zero/``):

* ZeRO-3 accumulates a window's reduced partitions in ``grad_partitions_flat_buffer``, copying the first
  micro-batch's and adding the later ones': a parameter reduced in no micro-batch keeps its slot from an earlier
  step, and one first reduced after the window's first micro-batch is added to it. Under optimizer offload the fp32
  gradient buffers (``fp32_partitioned_groups_flat[group].grad``, or the swap files on NVMe) are written at the
  window's end for the reduced parameters only;
* ZeRO-1/2 with optimizer offload copy the reduced gradients into ``single_partition_of_fp32_groups[group].grad``
  and accumulate them in ``accumulated_grads_in_cpu`` the same way.

So the previous step's gradient of such a parameter was applied again. And under optimizer offload, DeepSpeed copies
the window's gradient of a parameter to the optimizer only during the backward that closes the window (the boundary
a front end sets), so a parameter used in an earlier micro-batch of the window but not in its last one lost its
gradient to an older one.

:func:`clear_stale_gradients` wraps a ZeRO optimizer's ``step`` so that, before it, the parameters reduced in the
window but not copied at its end are copied now (DeepSpeed's own deferred copy, for just those), those no rank
reduced get a zero gradient partition (their clipping norms zero too), and after it the accumulation buffers are
zeroed for the next window. ZeRO-1/2 without offload build the window's gradients afresh (zeros for parameters
without one) and need nothing.

A zero gradient is what one process gives a parameter with SGD (no momentum or weight decay): the same weights. With
momentum, weight decay or Adam, a zero-gradient step still moves the parameter where one process would skip it.
"""

from __future__ import annotations

from typing import Any

import torch

from lightspeed.core.zero.swapped_gradients import zero_gradient_partition

__all__ = ["clear_stale_gradients", "complete_window_gradients"]


def clear_stale_gradients(optimizer: Any) -> None:
    """Make ``optimizer`` (DeepSpeed's ZeRO optimizer of an engine that trains) step with a zero gradient for the
    parameters no rank reduced in the window, never with one left from an earlier step (see the module docstring);
    nothing for other optimizers."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        after = _zero3_window_buffers_to_zero
    elif isinstance(optimizer, DeepSpeedZeroOptimizer) and optimizer.cpu_offload:
        after = _offloaded_window_buffers_to_zero
    else:
        return
    step = optimizer.step

    def step_without_stale_gradients(*args: Any, **kwargs: Any) -> Any:
        complete_window_gradients(optimizer)
        try:
            return step(*args, **kwargs)
        finally:
            after(optimizer)

    optimizer.step = step_without_stale_gradients


def complete_window_gradients(optimizer: Any) -> None:
    """After a window's last backward: give every parameter of ``optimizer`` (a ZeRO optimizer) the gradient of the
    whole window where the step reads it, zero for those no rank reduced (idempotent; it runs again before the step,
    and before anything scales the gradients in place)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        _zero3_unreduced_to_zero(optimizer)
    elif isinstance(optimizer, DeepSpeedZeroOptimizer) and optimizer.cpu_offload:
        _offloaded_unreduced_to_zero(optimizer)


def _zero3_unreduced_to_zero(optimizer: Any) -> None:
    """ZeRO-3 with optimizer offload: the parameters reduced in the window (``_offload_boundary_param_ids``, which
    ``step`` resets) but not copied at its end are copied now; those not reduced get a zero fp32 gradient partition
    and norm, written back to NVMe where it is swapped.
    Without offload the window's buffer was zeroed after the last step (:func:`_zero3_window_buffers_to_zero`)."""
    if not optimizer.offload_optimizer:
        return
    reduced = optimizer._offload_boundary_param_ids
    params = [param for group in optimizer.fp16_groups for param in group if param.requires_grad]
    # reduced in the window, but not copied by the backward that closed it (that copy takes the norm)
    missed = {
        p.ds_id
        for p in params
        if p.ds_id in reduced and optimizer.get_param_id(p) not in optimizer.norm_for_param_grads
    }
    if missed:
        optimizer._offload_boundary_param_ids = missed
        try:
            optimizer._finalize_offload_gradient_accumulation()
        finally:
            optimizer._offload_boundary_param_ids = reduced
    for param in params:
        if param.ds_id not in reduced:
            zeros = torch.zeros(param.ds_tensor.numel(), dtype=torch.float32)
            optimizer.set_local_grad_for_param(zeros, param)


def _zero3_window_buffers_to_zero(optimizer: Any) -> None:
    zero_gradient_partition(optimizer)  # without paging it in where the gradients are on NVMe


def _offloaded_unreduced_to_zero(optimizer: Any) -> None:
    """ZeRO-1/2 with optimizer offload: the parameters accumulated in the window but not copied at its end are copied
    now; the parameters of this rank's partition still without a gradient norm (the norms are taken as each reduced
    gradient is copied, and reset by every step) get zeros in the fp32 gradient partition."""
    optimizer._wait_for_offload_copies()
    accumulated = optimizer._offload_accumulated_param_ids
    # accumulated in the window, but not copied by the backward that closed it (that copy takes the norm)
    missed = {param_id for param_id in accumulated if param_id not in optimizer.norm_for_param_grads}
    if missed:
        optimizer._offload_accumulated_param_ids = missed
        try:
            optimizer._finalize_cpu_offload_gradient_accumulation()
        finally:
            optimizer._offload_accumulated_param_ids = accumulated
        optimizer._wait_for_offload_copies()
    for group, params in enumerate(optimizer.params_in_partition):
        flat = optimizer.single_partition_of_fp32_groups[group].grad
        if flat is None:
            continue
        for param in params:
            param_id = optimizer.get_param_id(param)
            if param_id not in optimizer.norm_for_param_grads:
                _, _, offset, numel = optimizer.grad_position[param_id]
                flat.view(-1).narrow(0, offset, numel).zero_()


def _offloaded_window_buffers_to_zero(optimizer: Any) -> None:
    for accumulated in optimizer.accumulated_grads_in_cpu.values():
        accumulated.zero_()
