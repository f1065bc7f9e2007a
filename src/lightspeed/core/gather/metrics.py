"""Exact metrics over one evaluation dataloader, equal to the single-process value, with or without Lightning.

:class:`LoaderMetrics` is the record of one dataloader: which of its samples are real (a
:class:`~lightspeed.core.gather.accounting.GatherState`), the outputs of the batches not gathered yet (a
:class:`~lightspeed.core.gather.window.BatchWindow`), the window size every rank agrees on without a collective, and
private copies of the metrics, updated once per global batch with the de-duplicated data. The ``GatherForMetrics``
callback keeps one per evaluation dataloader; :func:`exact_metrics` runs one over a plain loop (Lightning Fabric, or
``torch.distributed`` by hand).

A dataloader whose ranks run different numbers of batches (shards in which every sample is real,
:attr:`GatherState.batches_may_differ`) cannot be gathered window by window: :func:`uneven_dataloaders` finds such
dataloaders at the start of the epoch, and their outputs are gathered once at its end, joined by ranks with fewer
batches or none (:func:`uneven_layouts` tells those what to send).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torchmetrics import Metric, MetricCollection

from lightspeed.core.common.distributed import is_distributed, values_by_rank
from lightspeed.core.common.sizes import parse_size
from lightspeed.core.errors import CallSiteMismatchError, StepOutputError
from lightspeed.core.gather.accounting import GatherState
from lightspeed.core.gather.api import track
from lightspeed.core.gather.collective import comm_device
from lightspeed.core.gather.tree import as_leaf
from lightspeed.core.gather.window import (
    BatchWindow,
    batches_for_budget,
    batches_per_window,
    concat_samples,
    row_bytes,
)

__all__ = [
    "GatherEvery",
    "LoaderMetrics",
    "MetricLike",
    "WindowPolicy",
    "checked_metrics",
    "exact_metrics",
    "uneven_dataloaders",
    "uneven_layouts",
]

#: a torchmetrics ``Metric`` / ``MetricCollection`` (updated per batch) or ``fn(preds, target)`` (called once per epoch)
MetricLike = Metric | MetricCollection | Callable[[Any, Any], Any]
#: batches per gather: a number, or "auto" (sized to a byte budget), "batch" (1), "epoch" (all, at the end)
GatherEvery = int | Literal["auto", "batch", "epoch"]
#: torchmetrics objects: copied per dataloader onto the evaluation's device, updated per batch, computed and reset
STATEFUL = (Metric, MetricCollection)


def checked_metrics(metrics: Mapping[str, MetricLike] | None, owner: str) -> dict[str, MetricLike]:
    """``metrics`` as a dict, after checking that each is a torchmetrics object or a callable (``owner`` names the
    caller in the error)."""
    if metrics is not None and not isinstance(metrics, Mapping):
        raise TypeError(
            f"{owner} expects a dict of metrics such as {{'acc': MulticlassAccuracy(10)}}, got "
            f"{type(metrics).__name__}; wrap it: {owner}({{'name': metric}})."
        )
    for name, metric in (metrics or {}).items():
        if not (isinstance(metric, STATEFUL) or callable(metric)):
            raise TypeError(
                f"{owner}: metric {name!r} is a {type(metric).__name__}; pass a torchmetrics Metric or "
                "MetricCollection, or a callable(preds, target)."
            )
    return dict(metrics or {})


@dataclass(frozen=True)
class WindowPolicy:
    """How many batches one gather carries: ``gather_every`` and, for ``"auto"``, the bytes of outputs per rank."""

    gather_every: GatherEvery = "auto"
    buffer_limit: int = 4 << 20

    @classmethod
    def parse(cls, gather_every: GatherEvery, buffer_limit: int | str, owner: str) -> WindowPolicy:
        """Checked values from the user's arguments (``buffer_limit`` may be a size such as ``"4MiB"``)."""
        valid_count = isinstance(gather_every, int) and not isinstance(gather_every, bool) and gather_every >= 1
        if not valid_count and gather_every not in ("auto", "batch", "epoch"):
            raise ValueError(
                f"{owner}(gather_every={gather_every!r}): use 'auto', 'batch', 'epoch' or a number of batches >= 1."
            )
        return cls(gather_every, parse_size(buffer_limit, f"{owner}(buffer_limit=...)"))


class LoaderMetrics:
    """One evaluation dataloader's exact metrics (see the module docstring); kept for a whole run, reset per epoch.

    Args:
        metrics: the user's metrics; the torchmetrics ones are copied (with their cross-rank sync off: every rank
            updates with the global data) on the first update, so the objects passed in are never updated.
        policy: the gather window.
        name: the dataloader, unique among those evaluated together (``"validate dataloader 1"``).
        owner / step / keys: for error messages, who gathers (``"GatherForMetrics"``), the function that produces
            the outputs (``"validation_step"``) and the names it gives the predictions and targets.
        sequences: the run's sequence parallelism (duck-typed: ``size``, ``enabled`` and ``whole(outputs)``, as
            :class:`~lightspeed.core.sequence_parallel.SequenceParallel` has them), whose groups' ranks read the same
            rows and return slices of their sequences; ``None``: the one a Fabric loader carries as
            ``lightspeed_sequence_parallel``, if any.
    """

    def __init__(
        self,
        metrics: Mapping[str, MetricLike],
        policy: WindowPolicy,
        name: str,
        owner: str,
        step: str,
        keys: tuple[str, str] = ("preds", "target"),
        sequences: Any = None,
    ) -> None:
        self.metrics = dict(metrics)
        self.sequences = sequences
        self.policy, self.name, self.owner, self.step, self.keys = policy, name, owner, step, keys
        self.state: GatherState | None = None
        #: gathered once at the end of the epoch: the ranks run different (or unknown) numbers of batches
        self.uneven = False
        self._copies: dict[str, MetricLike] | None = None
        self._collected: dict[str, list[Any]] = {"preds": [], "target": []}
        self._window: BatchWindow | None = None
        self._window_size: int | None = None  # learnt by "auto"; kept from one epoch to the next
        self._batch_size: int | None = None

    def start_epoch(self, uneven: bool) -> None:
        """Forget the last epoch's samples and outputs (the metric copies are reset); the state is read again."""
        self.state, self.uneven, self._window = None, uneven, None
        self._collected = {"preds": [], "target": []}
        for metric in (self._copies or {}).values():
            if isinstance(metric, STATEFUL):
                metric.reset()

    def read_dataloader(self, dataloader: Iterable[Any]) -> GatherState:
        """This epoch's accounting, read from ``dataloader`` (and its batch size, which sizes "auto" windows)."""
        if self.sequences is None:
            self.sequences = getattr(dataloader, "lightspeed_sequence_parallel", None)
        ranks = self.sequences.size if self.sequences is not None else 1
        state = GatherState.from_dataloader(dataloader, name=self.name, ranks_per_replica=ranks)
        batch_size = getattr(dataloader, "batch_size", None)
        if batch_size is None and state.item_sizes is not None:  # a BatchSampler given as sampler=
            batch_size = state.item_sizes[0]
        self._batch_size = batch_size if isinstance(batch_size, int) and batch_size > 0 else None
        self.state = state
        return state

    def add(self, preds: Any, target: Any, device: torch.device) -> None:
        """Keep the current batch's predictions and targets (one row per sample); gathers when the window is full."""
        problem = self._rows_problem({self.keys[0]: preds, self.keys[1]: target})
        if problem is not None:
            self.add_problem(problem, device)
            return
        self._add({"preds": _detached(preds), "target": _detached(target)}, None, device)

    def add_step_outputs(self, outputs: tuple[Any, Any] | None, problem: str | None, device: torch.device) -> None:
        """What the step returned for the current batch: ``(preds, target)``, or ``None`` with the ``problem`` that
        kept them from it. Under sequence parallelism the group's slices are put back into whole sequences first (a
        collective in the group, which every rank joins, with or without outputs)."""
        sequences = self.sequences
        if sequences is not None and sequences.enabled:
            named = None if problem or outputs is None else dict(zip(self.keys, outputs, strict=True))
            whole, slice_problem = sequences.whole(named)
            outputs = None if whole is None else (whole[self.keys[0]], whole[self.keys[1]])
            problem = problem or (f"{self.owner}: {slice_problem}" if slice_problem else None)
        if problem is not None:
            self.add_problem(problem, device)
        else:
            assert outputs is not None  # whole() gives None only with a problem
            self.add(outputs[0], outputs[1], device)

    def add_problem(self, problem: str, device: torch.device) -> None:
        """The current batch has no usable outputs on this rank: every rank raises ``problem`` as a
        :class:`StepOutputError` at the gather of this batch's window (at once, on one process)."""
        if not is_distributed():
            raise StepOutputError(problem)
        self._add(None, problem, device)

    def gather_rest(self, device: torch.device, layouts: Mapping[str, Any]) -> None:
        """Gather what the epoch left in the window (collective at the end of the epoch; ``layouts`` from
        :func:`uneven_layouts`) and update the metrics."""
        if self.uneven and self.name in layouts:
            window = self._window or BatchWindow(first_sample=0)
            self._window = None
            assert self.state is not None  # uneven_layouts gives every rank a state
            batches = window.gather_uneven(self.state, layouts[self.name], device, error_type=StepOutputError)
            for outputs in batches:
                self._update(outputs["preds"], outputs["target"], device)
        else:
            self._gather_window(device)

    def compute(self, device: torch.device) -> dict[str, Any]:
        """Each metric's value over the epoch (the torchmetrics copies are reset), by name."""
        values: dict[str, Any] = {}
        for name, metric in self._metric_copies(device).items():
            if isinstance(metric, STATEFUL):
                values[name] = metric.compute()
                metric.reset()
            else:
                values[name] = metric(
                    concat_samples(self._collected["preds"]), concat_samples(self._collected["target"])
                )
        return values

    def layout(self) -> tuple[bool, Any]:
        """Whether this rank ran a batch of the dataloader, and its window's layout (for :func:`uneven_layouts`)."""
        window = self._window
        return window is not None, window.layout() if window is not None else None

    # the steps ------------------------------------------------------------------------------------------------

    def _add(self, kept: dict[str, Any] | None, problem: str | None, device: torch.device) -> None:
        state = self._current_state()
        if not is_distributed():  # nothing to gather: the outputs are the global batch
            assert kept is not None  # a problem raised in add_problem
            self._update(kept["preds"], kept["target"], device)
            return
        window = self._window
        if window is not None and kept is not None and not window.fits(kept):
            if self.uneven:  # a gather here would be on this rank only
                problem, kept = self._changing_outputs_problem(), None
            else:
                self._gather_window(device)
                window = None
        if window is None:
            window = self._window = BatchWindow(first_sample=state.batch_start)
        if self.policy.gather_every == "auto" and self._window_size is None and kept is not None and self._batch_size:
            # sized before any gather, from what every rank shares: the outputs' row size and the loader's batch size
            self._window_size = batches_for_budget(self.policy.buffer_limit, row_bytes(kept) * self._batch_size)
        if problem is not None:  # the other ranks gather this window with its batch: every rank raises there
            window.fail(problem)
        else:
            assert kept is not None  # kept is None exactly when there is a problem
            window.add(kept)
        if window.batches >= self._batches_per_window():
            self._gather_window(device)

    def _batches_per_window(self) -> float:
        """Batches the open window holds before it is gathered (the same on every rank)."""
        every = self.policy.gather_every
        if self.uneven or every == "epoch":
            return float("inf")  # gathered at the end of the epoch, which every rank reaches
        if every == "batch":
            return 1
        if every == "auto":
            return self._window_size or 1  # without a loader batch size, a first window of one batch measures
        return every

    def _gather_window(self, device: torch.device) -> None:
        """Gather the open window (collective) and update the metrics once per batch in it."""
        window, self._window = self._window, None
        if window is None:
            return
        try:
            batches = window.gather(self._current_state(), error_type=StepOutputError)
        except CallSiteMismatchError as err:
            raise CallSiteMismatchError(
                f"{err} {self.owner} gathers its outputs after the same batches on every rank (here a window of "
                f"{window.batches} batches), sized from the first batch's outputs and closed early when their shape "
                "or dtype changes; predictions or targets whose shape beyond dim 0 differs between ranks make the "
                "ranks gather at different batches: pad them in the step with "
                "lightspeed.pad_across_processes(tensor, dim=1, pad_index=...)."
            ) from None
        for outputs in batches:
            self._update(outputs["preds"], outputs["target"], device)
        if self.policy.gather_every == "auto":
            contributors = torch.distributed.get_world_size() // self._current_state().ranks_per_replica
            self._window_size = batches_per_window(self.policy.buffer_limit, batches, contributors, window.batches)

    def _update(self, preds: Any, target: Any, device: torch.device) -> None:
        """Feed globally gathered, de-duplicated predictions and targets to the metrics."""
        copies = self._metric_copies(device)
        if any(not isinstance(m, STATEFUL) for m in copies.values()):
            self._collected["preds"].append(preds)
            self._collected["target"].append(target)
        if not as_leaf(preds).rows:  # a batch without samples would only trip the metrics' input checks
            return
        for metric in copies.values():
            if isinstance(metric, STATEFUL):
                metric.update(preds, target)

    def _metric_copies(self, device: torch.device) -> dict[str, MetricLike]:
        if self._copies is None:
            self._copies = {}
            for name, metric in self.metrics.items():
                if isinstance(metric, STATEFUL):
                    metric = copy.deepcopy(metric).to(device)
                    _disable_sync(metric)
                self._copies[name] = metric
        return self._copies

    def _current_state(self) -> GatherState:
        if self.state is None:
            raise RuntimeError(f"LoaderMetrics({self.name!r}): read_dataloader() must come before the first batch.")
        return self.state

    def _rows_problem(self, outputs: Mapping[str, Any]) -> str | None:
        """Why an output holds other than one row per sample of the batch (and what to change); None when fine."""
        batch_size = self._current_state().batch_size
        for name, value in outputs.items():
            rows = as_leaf(value).rows
            if rows != batch_size:
                described = f"{rows} rows on dim 0" if rows is not None else _kind_of(value)
                return (
                    f"{self.owner}: {self.step} returned {name!r} with {described}, but the batch has {batch_size} "
                    "samples. Return one row per sample (dim 0 = the batch; e.g. preds.argmax(-1) of [batch, classes] "
                    "logits), so that the sampler's padding can be dropped."
                )
        return None

    def _changing_outputs_problem(self) -> str:
        return (
            f"{self.owner}: {self.step} returned predictions or targets whose dtype or shape beyond dim 0 changed "
            "between batches of a dataloader whose ranks run different numbers of batches; its outputs are gathered "
            "once at the end of the epoch, so they must keep one dtype and shape: pad them to a fixed size in the step."
        )


def uneven_dataloaders(
    dataloaders: Mapping[str, Any], batch_counts: Mapping[str, float], ranks_per_replica: int | None = None
) -> set[str]:
    """The dataloaders (by name) whose ranks run different numbers of batches this epoch, or cannot count them
    (``ranks_per_replica``: as :meth:`GatherState.from_dataloader` takes it).

    Only shards in which every sample is real may (:attr:`GatherState.batches_may_differ`); their counts (``inf``:
    unknown) are agreed in one object gather, made only when there is such a dataloader (every rank reads the same
    kinds of dataloaders, so every rank decides alike). A collective when distributed.
    """
    if not is_distributed():
        return set()
    candidates = [
        name
        for name, loader in dataloaders.items()
        if GatherState.from_dataloader(loader, name=name, ranks_per_replica=ranks_per_replica).batches_may_differ
    ]
    if not candidates:
        return set()
    by_rank = values_by_rank([float(batch_counts[name]) for name in candidates])
    return {
        name
        for column, name in enumerate(candidates)
        if any(rank[column] != by_rank[0][column] or math.isinf(rank[column]) for rank in by_rank)
    }


def uneven_layouts(records: Sequence[LoaderMetrics]) -> dict[str, Any]:
    """Per uneven dataloader that some rank ran a batch of, by name: the layout of a rank's window, which ranks without
    one send empty (None when no rank has outputs, e.g. every step failed).

    A collective when there is an uneven record; every rank must pass the same records in the same order. A rank that
    ran none of a dataloader's batches has no state for it yet: the caller reads one (:meth:`LoaderMetrics.
    read_dataloader`) for each name returned, so that every rank checks, gathers and reports the same dataloaders.
    """
    uneven = [record for record in records if record.uneven]
    if not uneven:
        return {}
    by_rank = values_by_rank([record.layout() for record in uneven])
    layouts = {}
    for column, record in enumerate(uneven):
        entries = [rank[column] for rank in by_rank]
        if any(has_window for has_window, _ in entries):  # else nothing to gather, as for any empty dataloader
            layouts[record.name] = next((layout for _, layout in entries if layout is not None), None)
    return layouts


def exact_metrics(
    dataloader: Iterable[Any],
    step: Callable[[Any], tuple[Any, Any]],
    metrics: Mapping[str, MetricLike],
    *,
    device: torch.device | str | None = None,
    gather_every: GatherEvery = "auto",
    buffer_limit: int | str = "4MiB",
) -> dict[str, Any]:
    """Evaluate ``metrics`` over every real sample of ``dataloader``: the value one process would compute over the
    whole dataset, for a loop without the Trainer (Lightning Fabric, or ``torch.distributed`` by hand).

    ``step(batch)`` returns ``(preds, target)``, one row per sample of the batch. Every rank calls this with its own
    dataloader (a collective). The outputs are gathered in windows of batches as ``GatherForMetrics`` does (the
    sampler's duplicates dropped, ``gather_every`` and ``buffer_limit`` as there), the torchmetrics metrics are
    updated once per global batch on copies (the objects passed in are not updated) and a plain ``fn(preds,
    target)`` is called once on everything gathered. Ranks may run different numbers of batches when every sample of
    their shards is real. Returns ``{name: value}``, the same on every rank. ``device`` holds the metric copies
    (default: that of the first predictions).

    Args:
        dataloader: this rank's evaluation dataloader (with a distributed sampler, or sharded with
            :func:`shard_iterable`).
        step: ``batch -> (preds, target)``, one row per sample of the batch.
        metrics: ``{name: metric}``: torchmetrics metrics (updated on copies) or plain ``fn(preds, target)`` callables.
        device: where the metric copies live; ``None``: the device of the first predictions.
        gather_every: batches per gather, as ``GatherForMetrics``'s: ``"auto"``, a number, ``"batch"`` or ``"epoch"``.
        buffer_limit: bytes of outputs per rank that ``"auto"`` aims at (an int or a size such as ``"4MiB"``).
    """
    owner = "lightspeed.exact_metrics"
    policy = WindowPolicy.parse(gather_every, buffer_limit, owner)
    record = LoaderMetrics(checked_metrics(metrics, owner), policy, "dataloader 0", owner, "step(batch)")
    given = torch.device(device) if device is not None else None

    def where(preds: Any = None) -> torch.device:
        """The metric copies' device: the caller's, else the first predictions', else the process group's."""
        nonlocal given
        if given is None and isinstance(preds, torch.Tensor):
            given = preds.device
        return given or _default_device()

    try:
        batches = float(len(dataloader))  # type: ignore[arg-type]
    except TypeError:  # an IterableDataset without __len__
        batches = math.inf
    record.start_epoch(uneven=bool(uneven_dataloaders({record.name: dataloader}, {record.name: batches})))
    state = record.read_dataloader(dataloader)
    for batch in track(dataloader, state):
        outputs = step(batch)
        if isinstance(outputs, tuple | list) and len(outputs) == 2:
            record.add_step_outputs((outputs[0], outputs[1]), None, where(outputs[0]))
        else:
            sized = f" of {len(outputs)}" if isinstance(outputs, tuple | list) else ""
            returned = f"a {type(outputs).__name__}{sized}"
            record.add_step_outputs(None, f"{owner}: step(batch) returned {returned}; return (preds, target).", where())
    record.gather_rest(where(), uneven_layouts([record]))
    return record.compute(where())


def _default_device() -> torch.device:
    """Where metric copies live when neither the caller nor a prediction says: the process group's device."""
    return comm_device() if is_distributed() else torch.device("cpu")


def _disable_sync(metric: Metric | MetricCollection) -> None:
    """Every rank updates with the global data already, so a cross-rank sync would count samples world_size times.

    Walks every ``Metric`` inside: a collection's members and the metrics that wrappers hold.
    """
    members = metric.values(copy_state=False) if isinstance(metric, MetricCollection) else [metric]
    for member in members:
        for module in member.modules():
            if not isinstance(module, Metric):
                continue
            module.sync_on_compute = False
            module.dist_sync_on_step = False
            module._to_sync = False


def _kind_of(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.is_nested:
        return "a nested tensor (convert it with .to_padded_tensor(pad_value))"
    if isinstance(value, torch.Tensor):
        return "a 0-d tensor"
    return f"a {type(value).__name__}"


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value
