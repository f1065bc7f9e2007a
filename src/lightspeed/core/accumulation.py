"""Exact gradient accumulation, framework-free: the update after ``N`` accumulated micro-batches equals the update
of one big batch holding all their items, on every rank count, for short last windows and uneven item counts.

The pieces (each in its own module):

* :class:`~lightspeed.core.accumulation_windows.AccumulationWindows`: where windows start and end, the real size of
  a short last window and the loss factor that repairs an ``N``-normalised loss.
* :class:`~lightspeed.core.accumulation_weights.ExactAccumulator`: per-micro-batch weights (items or samples), one
  count all-reduce per window and the gradient factor ``W / T`` (proof in that module's docstring).
* :func:`skip_gradient_sync`: the ``no_sync`` context for plain DDP-wrapped modules, so non-boundary micro-batches
  do not all-reduce gradients.

A plain PyTorch loop::

    accumulator = ExactAccumulator(world_size=dist.get_world_size())
    for window in windows:                      # lists of micro-batches
        for j, (inputs, targets, mask) in enumerate(window):
            last = j == len(window) - 1
            with contextlib.nullcontext() if last else skip_gradient_sync(ddp_model):
                loss_sum = loss_fn(ddp_model(inputs), targets, mask)      # summed over items
                (loss_sum * accumulator.record(loss_sum, num_items=mask.sum())).backward()
        accumulator.finish_window(model.parameters())
        optimizer.step()
        optimizer.zero_grad()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.nn import Module

from lightspeed.core.accumulation_weights import (
    ExactAccumulator,
    check_scalar_loss,
    count_samples,
    distributed_sum,
    scale_gradients,
)
from lightspeed.core.accumulation_windows import AccumulationWindows

__all__ = [
    "AccumulationWindows",
    "ExactAccumulator",
    "check_scalar_loss",
    "count_samples",
    "distributed_sum",
    "scale_gradients",
    "skip_gradient_sync",
]


@contextlib.contextmanager
def skip_gradient_sync(module: Module) -> Iterator[None]:
    """Run backward passes inside without gradient all-reduce when ``module`` has DDP's ``no_sync``; else a no-op.

    Gradients keep accumulating locally; the first backward outside the context all-reduces the accumulated sum.
    """
    no_sync = getattr(module, "no_sync", None)
    if callable(no_sync):
        with no_sync():
            yield
    else:
        yield
