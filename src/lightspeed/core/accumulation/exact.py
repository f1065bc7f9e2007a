"""Exact gradient accumulation, framework-free: the update after ``N`` accumulated micro-batches equals the update
of one big batch holding all their items, on every rank count, for short last windows and uneven item counts.

* :class:`ExactAccumulator`: per-micro-batch weights (items or samples), one count all-reduce per window and the
  gradient factor ``W / T`` applied at the window's end;
* :func:`scale_gradients`, :func:`distributed_sum`, :func:`check_scalar_loss`: the pieces it is built from, shared
  with the Lightning layer (:mod:`lightspeed.strategies.exact_accumulation`);
* :func:`skip_gradient_sync`: the ``no_sync`` context for plain DDP-wrapped modules, so non-boundary micro-batches
  do not all-reduce gradients.

Why the fix is needed
---------------------
Dividing each micro-batch loss by ``N`` (what Lightning and Accelerate do) gives the mean of per-micro-batch means. It
equals the big-batch mean only when every micro-batch holds the same number of items and the window is full; and DDP
then averages ranks as equals even when they saw different numbers of items.

The math (why ``W / T`` at the boundary is exact)
-------------------------------------------------
Index the window's micro-batches by rank ``r`` (``W`` ranks) and position ``j``. Each one runs backward on
``l_rj = m_rj * L_rj`` and reports an item count ``n_rj``:

* with ``num_items``: ``L_rj`` is a *sum* of per-item losses over its ``n_rj`` items and ``m_rj = 1``;
* without: ``L_rj`` is a *mean* over its ``b_rj`` samples, ``m_rj = n_rj = b_rj``, so ``l_rj`` is again the sum of
  per-sample losses.

During the window gradients accumulate locally without communication: ``G_r = sum_j grad(l_rj)``. The one gradient
sync at the boundary averages ranks (DDP, DeepSpeed): ``G = (1/W) sum_r G_r`` (a summing backend gives ``W G``). One
all-reduce of the counts gives ``T = sum_rj n_rj``. Then, by linearity of the gradient,

    (W / T) * G  =  (1/T) * sum_r sum_j grad(l_rj)  =  grad( (1/T) * sum over all items of the window of l_i ),

which is the gradient of the mean loss of the big batch made of every item the window saw on every rank: exactly
the full-batch gradient. The factor is a scalar, so applying it to the gradients after the sync equals scaling
every loss before backward; it has to be applied afterwards because ``T`` is only known once the window's last
micro-batch has reported its count. That is also why a short window needs no advance notice: its ``T`` simply
counts fewer items. If the framework already divided each loss by ``N``, :meth:`ExactAccumulator.record` folds ``N``
back into the returned multiplier.

Weights relative to a full window (``window_items``): dividing every multiplier by the same ``E`` (the samples one
rank's full window holds, equal on every rank) and multiplying the factor by ``E`` changes nothing above. With
``E = N * b`` for ``N`` micro-batches of ``b`` samples, a full window gives ``T = W * E`` and the factor
``W * E / T = 1``: the synced gradients are the big-batch gradient as soon as backward ends (where hooks read them),
and there is nothing left to rescale. A short or uneven window still gets its exact factor.

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
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module

__all__ = [
    "ExactAccumulator",
    "check_scalar_loss",
    "distributed_sum",
    "scale_gradients",
    "scale_tensors",
    "skip_gradient_sync",
]

AllReduceSum = Callable[[Tensor], Tensor]


def distributed_sum(tensor: Tensor) -> Tensor:
    """Sum ``tensor`` in place over the default ``torch.distributed`` group; unchanged when not distributed."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor


def check_scalar_loss(loss: Any) -> Tensor:
    """Return ``loss`` if it is a one-element tensor, else raise an error saying how to reduce it."""
    if not isinstance(loss, Tensor):
        raise TypeError(
            f"training_step must return the loss as a torch.Tensor for exact gradient accumulation, "
            f"got {type(loss).__name__}."
        )
    if loss.numel() != 1:
        raise ValueError(
            f"training_step must return a scalar loss for exact gradient accumulation, got a tensor of shape "
            f"{tuple(loss.shape)}. Reduce it first: loss.mean(), or loss.sum() together with num_items."
        )
    return loss


def scale_gradients(parameters: Iterable[Tensor], factor: float) -> None:
    """Multiply every existing ``.grad`` in place by ``factor``."""
    if factor != 1.0:
        scale_tensors([param.grad for param in parameters if param.grad is not None], factor)


def scale_tensors(tensors: Iterable[Tensor], factor: float) -> None:
    """Multiply ``tensors`` in place by ``factor`` (grouped by device and dtype, one kernel per group)."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    for group in groups.values():
        torch._foreach_mul_(group, factor)


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


class ExactAccumulator:
    """Tracks one accumulation window's item counts and yields the factor that makes its gradient exact.

    Use: call :meth:`record` for every micro-batch (multiply its loss by the returned value before backward), keep
    gradient sync off on every micro-batch but the window's last, then call :meth:`finish_window` after the last
    backward and before clipping / the optimizer step. The module docstring proves the result.

    Args:
        world_size: number of ranks whose gradients the backend's sync combines.
        all_reduce_sum: sums a small tensor over ranks in place and returns it; defaults to
            :func:`distributed_sum`. Called once per window when ``world_size > 1``.
        gradients_averaged: the backend's sync averages gradients over ranks (DDP, DeepSpeed) rather than summing.
        device: device of the count tensor before the first loss is seen (later: the first loss's device).
    """

    def __init__(
        self,
        world_size: int = 1,
        all_reduce_sum: AllReduceSum | None = None,
        gradients_averaged: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}.")
        self.world_size = world_size
        self.all_reduce_sum = all_reduce_sum or distributed_sum
        self.gradients_averaged = gradients_averaged
        self._device = torch.device(device) if device is not None else None
        #: [items, micro-batches that gave num_items, micro-batches, the window's expected items], float64
        self._counts: Tensor | None = None
        self._expected: float | None = None  # the current window's ``window_items`` (None: not given)
        self.micro_batches = 0  # local micro-batches recorded in the current window (a full-window check reads it)

    def start_window(self) -> None:
        """Forget the current window's counts (call where gradients are zeroed)."""
        self._counts = None
        self._expected = None
        self.micro_batches = 0

    def _counter(self, device: torch.device | None) -> Tensor:
        if self._counts is None:
            self._counts = torch.zeros(4, dtype=torch.float64, device=device or self._device or "cpu")
        return self._counts

    def record(
        self,
        loss: Tensor,
        num_items: int | float | Tensor | None = None,
        num_samples: int | None = None,
        normalized_by: int = 1,
        window_items: float | None = None,
    ) -> float:
        """Note one micro-batch and return the multiplier for its loss before backward.

        Args:
            loss: the micro-batch loss: a sum over items when ``num_items`` is given, else a mean over samples.
            num_items: items the summed loss covers (tokens, ...); a tensor is counted without a host sync.
            num_samples: samples in the micro-batch, weighting a mean loss; ``None`` weighs the micro-batch as 1.
            normalized_by: what the framework already divided ``loss`` by (Lightning: ``accumulate_grad_batches``).
            window_items: the samples one rank's full window holds (micro-batches x the configured micro-batch size),
                the same on every rank and for the whole window. Weights are taken relative to it, so a full window
                of equal micro-batches needs no gradient factor at all (:meth:`window_factor` returns exactly 1):
                the gradients are right as soon as backward ends, where hooks read them, and nothing rescales them.
                Ignored for micro-batches with ``num_items``.
        """
        check_scalar_loss(loss)
        counts = self._counter(loss.device)
        if num_items is None and window_items is not None:
            if self._expected is None:
                self._expected = float(window_items)
                counts[3] += self._expected
            elif self._expected != float(window_items):
                raise ValueError(
                    f"window_items changed inside an accumulation window ({self._expected:g}, then {window_items:g}); "
                    "it must stay the same until the window's factor is taken."
                )
        if num_items is not None:
            if isinstance(num_items, Tensor):
                if num_items.numel() != 1:
                    raise ValueError(
                        f"num_items must be a single count, got a tensor of shape {tuple(num_items.shape)}. "
                        f"Return e.g. mask.sum()."
                    )
                counts[0] += num_items.detach().reshape(()).to(device=counts.device, dtype=counts.dtype)
            else:
                if isinstance(num_items, bool) or not isinstance(num_items, (int, float)):
                    raise TypeError(
                        f"num_items must be a number or a one-element tensor, got {type(num_items).__name__}."
                    )
                if not math.isfinite(num_items) or num_items < 0:
                    raise ValueError(f"num_items must be a finite count >= 0, got {num_items}.")
                counts[0] += float(num_items)
            counts[1] += 1
            weight = 1.0
        else:
            weight = float(num_samples) if num_samples is not None else 1.0
            if weight < 0:
                raise ValueError(f"num_samples must be >= 0, got {num_samples}.")
            counts[0] += weight
        counts[2] += 1
        self.micro_batches += 1
        if num_items is None and self._expected:
            return float(normalized_by) * weight / self._expected
        return float(normalized_by) * weight

    def window_factor(self) -> float:
        """All-reduce the window's counts once, check them, start a new window and return the gradient factor."""
        counts = self._counter(None).clone()
        expected = self._expected
        self.start_window()
        if self.world_size > 1:
            counts = self.all_reduce_sum(counts)
        total_items, item_batches, total_batches, expected_sum = (float(value) for value in counts.tolist())
        if total_batches == 0:
            return 1.0
        if expected_sum != (expected or 0.0) * self.world_size:
            raise ValueError(
                f"The ranks weighted this accumulation window against different sizes (this rank: {expected or 0:g} "
                f"samples per window; all ranks together: {expected_sum:g}). Every rank must run the same "
                "micro-batch size and accumulate_grad_batches."
            )
        if 0 < item_batches < total_batches:
            raise ValueError(
                f"training_step returned num_items for {item_batches:g} of the window's {total_batches:g} "
                f"micro-batches (all ranks): return it from every training_step or from none."
            )
        if not math.isfinite(total_items) or total_items <= 0:
            raise ValueError(
                f"num_items summed to {total_items:g} over an accumulation window ({total_batches:g} micro-batches on "
                f"all ranks), so the window's mean loss is undefined. Every window of accumulate_grad_batches "
                f"micro-batches needs at least one item: drop empty batches or count the items correctly."
            )
        ranks = self.world_size if self.gradients_averaged else 1
        return ranks * (expected or 1.0) / total_items

    def finish_window(self, parameters: Iterable[Tensor]) -> float:
        """:meth:`window_factor`, applied in place to the gradients of ``parameters``; returns the factor."""
        factor = self.window_factor()
        scale_gradients(parameters, factor)
        return factor
