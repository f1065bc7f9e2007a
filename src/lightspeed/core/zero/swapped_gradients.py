"""ZeRO-3 with the optimizer on NVMe: the host memory of DeepSpeed's gradient partition held only while it is used.

DeepSpeed 0.19 keeps each rank's whole gradient partition in one host tensor for the whole run
(``grad_partitions_flat_buffer``: 4 bytes a parameter in fp32, over the world size; 4.2 GB per rank for a 2B model on
2 ranks, more than everything else a ``zero3_nvme`` rank holds in its steps). With the optimizer states on NVMe, a
parameter's slot there is live only from its first reduction in an accumulation window until the backward that closes
the window swaps it out to NVMe; the step reads the NVMe copy, and the slots are then zeroed for the next window
(:mod:`~lightspeed.core.zero.stale_gradients`).

:func:`gradient_partition_allocated_untouched` has DeepSpeed allocate the buffer without writing its zeros (fresh
pages read as zeros), so that building the optimizer does not page in the whole partition either.

:func:`release_swapped_gradients` gives each slot's pages back to the operating system
(:mod:`~lightspeed.core.common.page_release`) right after the closing backward swapped it out, and
:func:`zero_gradient_partition` zeroes the buffer after the step by giving its pages back instead of writing them
(they read as zeros). So the buffer holds a reduce bucket's worth in the closing backward, and in the other
micro-batches of a window only the slots reduced so far. Kept: the slots DeepSpeed still refers to after the swap-out
(gradients too small or too short for its asynchronous I/O stay in memory, its ``unswapped_gradients``). Not under
fp16, whose overflow check reads the whole buffer after the swap-out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from lightspeed.core.common.page_release import byte_range, give_back_pages, zero_without_touching

__all__ = [
    "gives_back_gradient_memory",
    "gradient_partition_allocated_untouched",
    "release_swapped_gradients",
    "zero_gradient_partition",
]

#: zero-filled CPU tensors from this many bytes up are allocated without writing their pages (optimizer build)
_UNTOUCHED_FROM_BYTES = 1 << 20


def gives_back_gradient_memory(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a ZeRO-3 optimizer whose gradients are swapped to NVMe, outside fp16."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return (
        isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3)
        and bool(optimizer.offload_optimizer)
        and bool(getattr(optimizer, "swap_optimizer", False))
        and optimizer.dtype != torch.float16
        and getattr(optimizer, "grad_partitions_flat_buffer", None) is not None
    )


def zero_gradient_partition(optimizer: Any) -> None:
    """Zero ``optimizer``'s gradient partition buffer for the next window, without paging it in where its gradients
    are on NVMe."""
    buffer = optimizer.grad_partitions_flat_buffer
    if buffer is None:
        return
    if gives_back_gradient_memory(optimizer):
        zero_without_touching(buffer)
    else:
        buffer.zero_()


def _still_referred_to(optimizer: Any) -> list[tuple[int, int]]:
    """Byte ranges of the gradients the NVMe swapper keeps in memory instead of writing them out."""
    infos = optimizer.optimizer_swapper.swap_params_info.values()
    return [byte_range(tensor) for info in infos for tensor in info.unswapped_gradients.values()]


def _give_back(slots: Iterable[torch.Tensor], kept: list[tuple[int, int]]) -> None:
    for slot in slots:
        start, end = byte_range(slot)
        if not any(k_start < end and start < k_end for k_start, k_end in kept):
            give_back_pages(start, end)


def release_swapped_gradients(optimizer: Any) -> bool:
    """Make ``optimizer`` give back the memory of its gradient slots once they are on NVMe and zero its buffer
    without paging it in (see the module's docstring); False, changing nothing, where it does not swap gradients."""
    if not gives_back_gradient_memory(optimizer):
        return False
    partition_grads = optimizer.partition_grads

    def partition_and_release(params: Any, grad_partitions: Any) -> Any:
        slots = partition_grads(params, grad_partitions)
        if optimizer.is_gradient_accumulation_boundary() and slots:
            _give_back(slots, _still_referred_to(optimizer))  # swapped out to NVMe by the call above
        return slots

    optimizer.partition_grads = partition_and_release
    zero_without_touching(optimizer.grad_partitions_flat_buffer)  # zeros since it was allocated
    return True


class _TorchAllocatingZerosUntouched:
    """``torch`` as DeepSpeed's ZeRO-3 module sees it while its optimizer is built: the same, except that a large
    zero-filled CPU tensor is allocated without writing its pages (they read as zeros until written)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*size: Any, **options: Any) -> torch.Tensor:
        tensor = torch.zeros(0, **options)  # dtype, device and any option checked by torch itself
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
        if tensor.device.type != "cpu" or set(options) - {"dtype", "device"}:
            return torch.zeros(*size, **options)
        tensor = torch.empty(shape, dtype=tensor.dtype, device="cpu")
        if tensor.numel() * tensor.element_size() < _UNTOUCHED_FROM_BYTES:
            return tensor.zero_()
        zero_without_touching(tensor)
        return tensor


def _swaps_gradients(config: dict[str, Any]) -> bool:
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict) or zero.get("stage") != 3 or (config.get("fp16") or {}).get("enabled"):
        return False
    offload = zero.get("offload_optimizer")
    return isinstance(offload, dict) and offload.get("device") == "nvme"


@contextlib.contextmanager
def gradient_partition_allocated_untouched(config: dict[str, Any]) -> Iterator[None]:
    """Within the block, a ZeRO-3 optimizer built under ``config`` with its states on NVMe (outside fp16) allocates its
    gradient partition (and any other large zero-filled host tensor) without paging it in; a no-op otherwise."""
    if not _swaps_gradients(config):
        yield
        return
    from deepspeed.runtime.zero import stage3

    stage3_module: Any = stage3
    stage3_module.torch = _TorchAllocatingZerosUntouched()
    try:
        yield
    finally:
        stage3_module.torch = torch
