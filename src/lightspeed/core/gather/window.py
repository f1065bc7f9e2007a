"""Outputs of consecutive evaluation batches kept on one rank and gathered together, then split back per batch.

A collective costs a fixed latency whatever it carries (about a millisecond over gloo between CPU processes, tens
of microseconds over NCCL), so gathering small per-batch outputs (class predictions, targets) one batch at a time
can cost as much as evaluating the batch. A :class:`BatchWindow` keeps the outputs of consecutive batches of one
dataloader, gathers them with one :func:`~lightspeed.core.gather.api.gather_for_metrics` call that names the window's
first sample (so the sampler's padding is still dropped exactly), and splits the result back into global batches:
a metric is still updated once per batch, with the same samples a per-batch gather would have given it.

Every rank must close its windows after the same batches, so window sizes come only from what is the same on every
rank: :func:`batches_for_budget` of the bytes of a batch, estimated before the first gather from the size of one
sample's outputs (:func:`row_bytes`, equal across ranks whenever their outputs can be gathered at all) times the
dataloader's batch size, and after each gather from the gathered data (:func:`batches_per_window`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightspeed.core.errors import GatherError
from lightspeed.core.gather.accounting import GatherState
from lightspeed.core.gather.api import gather_samples
from lightspeed.core.gather.collective import fail_gather
from lightspeed.core.gather.tree import as_leaf

#: name of the extra gathered leaf holding each sample's batch number (chosen not to collide with output names)
_BATCH_KEY = "__lightspeed_batch__"
#: bytes counted per Python object in a per-sample list (its real size is unknown before pickling)
_OBJECT_BYTES = 64


@dataclass
class BatchWindow:
    """This rank's outputs of consecutive batches of one dataloader, not yet gathered.

    ``first_sample`` is the position (among the samples this rank produced this epoch) of the first batch's first
    sample. Each batch adds a mapping of named outputs whose dim 0 is that batch's samples, or a problem that makes
    every rank raise at the window's gather instead.
    """

    first_sample: int
    batches: int = 0
    problem: str | None = None
    _outputs: list[Mapping[str, Any]] = field(default_factory=list)
    _numbers: list[torch.Tensor] = field(default_factory=list)
    _layout: dict[str, Any] | None = None

    def fits(self, outputs: Mapping[str, Any]) -> bool:
        """Whether ``outputs`` can be concatenated to the window (same names, dtypes, devices and trailing dims)."""
        return self._layout is None or self._layout == _layout(outputs)

    def add(self, outputs: Mapping[str, Any]) -> None:
        """Keep one batch's outputs (already detached); rows must equal the batch's samples."""
        if not self.fits(outputs):
            raise ValueError("BatchWindow.add: these outputs do not fit the window; gather it first (see fits()).")
        self._layout = self._layout or _layout(outputs)
        rows = as_leaf(next(iter(outputs.values()))).rows if outputs else 0
        if rows is None:
            raise ValueError("BatchWindow.add: the first output has no sample dimension (a 0-d tensor or an object).")
        self._outputs.append(outputs)
        self._numbers.append(torch.full((rows,), self.batches, dtype=torch.int32))
        self.batches += 1

    def fail(self, problem: str) -> None:
        """Record that this rank could not produce one batch's outputs; the window's gather raises it everywhere."""
        self.problem = self.problem or problem
        self.batches += 1

    def gather(self, state: GatherState, error_type: type[GatherError] = GatherError) -> list[dict[str, Any]]:
        """Gather the window from every rank (collective) and return one mapping of outputs per global batch.

        A recorded problem is raised on every rank as ``error_type`` (naming this rank). Batches in which no rank
        has a real sample are left out, as a per-batch gather would give them no rows.
        """
        if self.problem is not None:
            fail_gather(error_type(self.problem), state)
        if not self._outputs:
            raise ValueError("BatchWindow.gather: the window holds no batch; add() one first.")
        if self.batches == 1:  # every rank's window holds one batch (sizes agree): nothing to split
            gathered = gather_samples(dict(self._outputs[0]), state=state, first_sample=self.first_sample)
            return [gathered] if as_leaf(next(iter(gathered.values()))).rows else []
        data = {name: concat_samples([o[name] for o in self._outputs]) for name in self._outputs[0]}
        data[_BATCH_KEY] = torch.cat(self._numbers)
        gathered = gather_samples(data, state=state, first_sample=self.first_sample)
        numbers = gathered.pop(_BATCH_KEY)
        return split_by_batch(gathered, numbers)

    def layout(self) -> dict[str, Any] | None:
        """What another rank needs to send empty outputs in this window's place (:meth:`gather_uneven`): per output,
        ``(dtype, trailing dims)`` of a tensor or the sequence type of per-sample objects; None before the first batch.
        Picklable, without devices (each rank's outputs live on its own)."""
        if self._layout is None:
            return None
        return {name: (kind[0], kind[2]) if isinstance(kind, tuple) else kind for name, kind in self._layout.items()}

    def gather_uneven(
        self,
        state: GatherState,
        layout: Mapping[str, Any] | None,
        device: torch.device,
        error_type: type[GatherError] = GatherError,
    ) -> list[dict[str, Any]]:
        """Gather a window whose number of batches may differ between the ranks, down to none (collective: every rank
        calls it, with or without batches).

        Every rank sends its samples' batch numbers, so that the result is split into the same global batches on every
        rank (batch ``i`` holds every rank's ``i``-th batch). A window without batches sends empty outputs made from
        ``layout`` (the :meth:`layout` of a window on another rank, or None when no rank has outputs) on ``device``.
        """
        if self.problem is not None:
            fail_gather(error_type(self.problem), state)
        if self._outputs:
            data = {name: concat_samples([o[name] for o in self._outputs]) for name in self._outputs[0]}
            numbers = torch.cat(self._numbers)
        else:
            data = {name: _empty(kind, device) for name, kind in (layout or {}).items()}
            numbers = torch.zeros(0, dtype=torch.int32)
        data[_BATCH_KEY] = numbers
        gathered = gather_samples(data, state=state, first_sample=self.first_sample)
        return split_by_batch(gathered, gathered.pop(_BATCH_KEY))


def _empty(kind: Any, device: torch.device) -> Any:
    """No samples of one output described by :meth:`BatchWindow.layout`."""
    if isinstance(kind, tuple):
        dtype, trailing = kind
        return torch.empty((0, *trailing), dtype=dtype, device=device)
    return kind()


def split_by_batch(outputs: Mapping[str, Any], numbers: torch.Tensor) -> list[dict[str, Any]]:
    """Split gathered outputs into batches by each sample's batch number, keeping the order within a batch."""
    if numbers.numel() > 1 and not bool((numbers[1:] >= numbers[:-1]).all()):
        order = torch.argsort(numbers, stable=True)  # shards come back rank by rank: regroup them by batch
        numbers = numbers[order]
        outputs = {name: _take(value, order) for name, value in outputs.items()}
    if numbers.numel() == 0:
        return []
    sizes = torch.unique_consecutive(numbers, return_counts=True)[1].tolist()
    pieces = {name: _split(value, sizes) for name, value in outputs.items()}
    return [{name: pieces[name][i] for name in outputs} for i in range(len(sizes))]


def batches_for_budget(limit_bytes: int, batch_bytes: float) -> int:
    """The largest power of two of batches of ``batch_bytes`` that fits ``limit_bytes`` (at least 1).

    Rounding to a power of two keeps ranks whose estimates differ slightly on the same window size.
    """
    fitting = int(limit_bytes // max(1.0, batch_bytes))
    return 1 << (max(1, fitting).bit_length() - 1)


def row_bytes(outputs: Mapping[str, Any]) -> int:
    """Bytes of one sample's outputs: itemsize x trailing dims per tensor, an estimate per Python object."""
    total = 0
    for value in outputs.values():
        if isinstance(value, torch.Tensor):
            total += value.element_size() * math.prod(value.shape[1:])
        else:
            total += _OBJECT_BYTES
    return total


def batches_per_window(limit_bytes: int, gathered: Sequence[Mapping[str, Any]], world_size: int, batches: int) -> int:
    """Batches the next window may hold so that one rank keeps about ``limit_bytes`` of outputs (at least 1).

    ``gathered`` is the previous window's result (the same on every rank) and ``batches`` the number of batches
    it spanned, so every rank computes the same size.
    """
    total = sum(_nbytes(value) for batch in gathered for value in batch.values())
    return batches_for_budget(limit_bytes, total / max(1, world_size * batches))


def _layout(outputs: Mapping[str, Any]) -> dict[str, Any]:
    return {
        name: (value.dtype, value.device, tuple(value.shape[1:])) if isinstance(value, torch.Tensor) else type(value)
        for name, value in outputs.items()
    }


def concat_samples(parts: list[Any]) -> Any:
    """One output of consecutive batches joined along the samples: a tensor, or a list of per-sample objects."""
    if parts and isinstance(parts[0], torch.Tensor):
        return torch.cat(parts) if len(parts) > 1 else parts[0]
    return [item for part in parts for item in part]


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return len(value) * _OBJECT_BYTES


def _take(value: Any, order: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor):
        return value.index_select(0, order.to(value.device))
    return type(value)(value[i] for i in order.tolist())


def _split(value: Any, sizes: list[int]) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return list(torch.split(value, sizes))
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return [value[start:end] for start, end in itertools.pairwise(bounds)]


__all__ = ["BatchWindow", "batches_for_budget", "batches_per_window", "concat_samples", "row_bytes", "split_by_batch"]
