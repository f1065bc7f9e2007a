"""``GatherForMetrics``: validation/test metrics over exactly the real samples, equal to the single-process value.

The callback keeps one :class:`~lightspeed.core.gather.accounting.GatherState` per evaluation dataloader (read from its
sampler and dataset at the first batch of each epoch) and makes it the current state around every batch, so
``lightspeed.gather_for_metrics`` called inside ``validation_step`` / ``test_step`` (or once in
``on_validation_epoch_end``) drops the sampler's duplicates without being told anything.

With metrics, it also reads ``outputs[preds_key]`` and ``outputs[target_key]`` from what the step returns,
gathers them (de-duplicated), updates its own copies of the metrics once per batch with the global data, and at
epoch end logs ``val/<name>`` / ``test/<name>`` (plus ``/dataloader_idx_<i>`` when there are several dataloaders)
with ``sync_dist=False``: every rank already holds the global value. torchmetrics' own cross-rank sync is turned
off on these copies, since it would count every sample ``world_size`` times. Lightning's hint to log such values
with ``sync_dist=True`` is silenced for exactly these names, for the duration of the Trainer run.

A metric is either a torchmetrics ``Metric`` or ``MetricCollection`` (copied per dataloader onto the module's device
at the start of every Trainer run, so the object passed in is never updated, and updated per batch) or a plain
callable ``fn(preds, target) -> value`` (called once per epoch on everything gathered). Under a single device the
gathers are no-ops and the callback simply computes the metrics.

Outputs are gathered in windows of consecutive batches (:mod:`lightspeed.core.gather.window`): one collective for
many small batches, since each collective has a fixed latency; the window is split back into batches afterwards,
so the metrics see exactly what a gather per batch would give them. ``gather_every`` sets the window: ``"auto"``
(default: as many batches as keep about ``buffer_limit`` bytes of outputs per rank, from the first batch's output
shapes times the loader's batch size, so every rank decides alike without a collective), a number of batches,
``"batch"`` (1) or ``"epoch"`` (everything, once at epoch end).

Ranks may run different numbers of batches of a dataloader whose every sample is real (no DistributedSampler: a
hand-made split with ``use_distributed_sampler=False``, an IterableDataset sharded unevenly without ``__len__``). At the
start of each epoch the ranks agree on their batch counts of such dataloaders (one small object gather; none when every
dataloader has a DistributedSampler); where the counts differ or are unknown, that dataloader's outputs are kept until
the end of the epoch and gathered there in one collective, which a rank that ran fewer batches (or none) joins with
what it has. The metrics are still updated once per global batch (every rank's ``i``-th batch together), and equal the
single-process metrics.

If a step's output lacks ``preds_key`` / ``target_key`` on some rank, or holds other than one row per sample, every
rank raises the same :class:`StepOutputError` (a :class:`~lightspeed.core.errors.GatherError`) at that
window's gather instead of the others waiting for it.
"""

from __future__ import annotations

import copy
import math
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torchmetrics import Metric, MetricCollection
from typing_extensions import override

from lightspeed.core.common.distributed import is_distributed, values_by_rank
from lightspeed.core.common.sizes import parse_size
from lightspeed.core.errors import CallSiteMismatch, StepOutputError
from lightspeed.core.gather.accounting import GatherState, current_state, set_current_state
from lightspeed.core.gather.api import end_of_dataloader
from lightspeed.core.gather.tree import as_leaf
from lightspeed.core.gather.window import (
    BatchWindow,
    batches_for_budget,
    batches_per_window,
    concat_samples,
    row_bytes,
)

__all__ = ["GatherForMetrics"]

_MetricLike = Metric | MetricCollection | Callable[[Any, Any], Any]
#: torchmetrics objects: deep-copied, moved to the module's device, updated per batch, computed and reset per epoch
_STATEFUL = (Metric, MetricCollection)
#: evaluation stages each Trainer entry point runs
_RUN_STAGES = {"fit": ("validate",), "validate": ("validate",), "test": ("test",)}


class GatherForMetrics(Callback):
    """Exact distributed evaluation metrics (see the module docstring).

    Args:
        metrics: ``{"acc": MulticlassAccuracy(10), "f1": some_fn}``; ``None`` to only track the dataloaders for
            hand-written ``gather_for_metrics`` calls.
        preds_key / target_key: keys of the dict that ``validation_step`` / ``test_step`` returns.
        val_prefix / test_prefix: prefixes of the logged names.
        gather_every: how many consecutive batches one gather carries: ``"auto"`` (default) sizes the window so
            that a rank keeps about ``buffer_limit`` bytes of outputs; an int N gathers every N batches;
            ``"batch"`` every batch (the metrics are updated right after each batch); ``"epoch"`` once at epoch
            end (memory for the epoch's outputs). A batch whose outputs change dtype or trailing shape closes the
            window before it. Whatever the window, the metrics are updated once per batch with the same data.
        buffer_limit: bytes of outputs per rank that ``"auto"`` aims at (an int or a size such as ``"4MiB"``).
    """

    def __init__(
        self,
        metrics: Mapping[str, _MetricLike] | None = None,
        preds_key: str = "preds",
        target_key: str = "target",
        val_prefix: str = "val/",
        test_prefix: str = "test/",
        gather_every: int | Literal["auto", "batch", "epoch"] = "auto",
        buffer_limit: int | str = "4MiB",
    ) -> None:
        valid_count = isinstance(gather_every, int) and not isinstance(gather_every, bool) and gather_every >= 1
        if not valid_count and gather_every not in ("auto", "batch", "epoch"):
            raise ValueError(
                f"GatherForMetrics(gather_every={gather_every!r}): use 'auto', 'batch', 'epoch' or a number of "
                "batches >= 1."
            )
        if metrics is not None and not isinstance(metrics, Mapping):
            raise TypeError(
                f"GatherForMetrics expects a dict of metrics such as {{'acc': MulticlassAccuracy(10)}}, got "
                f"{type(metrics).__name__}; wrap it: GatherForMetrics({{'name': metric}})."
            )
        for name, metric in (metrics or {}).items():
            if not (isinstance(metric, _STATEFUL) or callable(metric)):
                raise TypeError(
                    f"GatherForMetrics: metric {name!r} is a {type(metric).__name__}; pass a torchmetrics Metric or "
                    "MetricCollection, or a callable(preds, target)."
                )
        self.metrics: dict[str, _MetricLike] = dict(metrics or {})
        self.preds_key, self.target_key = preds_key, target_key
        self.gather_every = gather_every
        self.buffer_limit = parse_size(buffer_limit, "GatherForMetrics(buffer_limit=...)")
        self.prefixes = {"validate": val_prefix, "test": test_prefix}
        self.states: dict[str, dict[int, GatherState]] = {}
        self.results: dict[str, dict[str, Any]] = {}  # stage -> logged name -> value, from the last epoch
        # per Trainer run (re-created in setup), keyed by (stage, dataloader_idx): metric copies on the module's
        # device, gathered outputs kept for plain-callable metrics, the open window and the next window's size
        self._copies: dict[tuple[str, int], dict[str, _MetricLike]] = {}
        self._collected: dict[tuple[str, int], dict[str, list[Any]]] = {}
        self._windows: dict[tuple[str, int], BatchWindow] = {}
        self._window_sizes: dict[tuple[str, int], int] = {}
        self._loader_batch_sizes: dict[tuple[str, int], int | None] = {}
        #: stage -> dataloaders whose ranks run different (or unknown) numbers of batches this epoch: gathered once,
        #: at the end of the epoch
        self._uneven: dict[str, set[int]] = {}
        self._silenced: dict[str, Any] = {}  # logged name -> the warnings filter this run installed for it

    # hooks ------------------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # a new run may be on another device and must not see the previous run's samples
        self._copies, self._collected, self._windows, self._window_sizes, self._loader_batch_sizes = {}, {}, {}, {}, {}
        self._uneven = {}
        for run_stage in _RUN_STAGES.get(stage, ()):
            self.states.pop(run_stage, None)
            self.results.pop(run_stage, None)

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_start(trainer, "validate")

    @override
    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_start(trainer, "test")

    @override
    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._batch_start(trainer, "validate", batch, dataloader_idx)

    @override
    def on_test_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._batch_start(trainer, "test", batch, dataloader_idx)

    @override
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch_end(pl_module, "validate", outputs, dataloader_idx)

    @override
    def on_test_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch_end(pl_module, "test", outputs, dataloader_idx)

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_end(trainer, pl_module, "validate")

    @override
    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_end(trainer, pl_module, "test")

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._clear_context()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._clear_context()
        self._restore_warnings()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._clear_context()
        self._restore_warnings()

    # work ---------------------------------------------------------------------------------------------------------

    def state_for(self, stage: str = "validate", dataloader_idx: int = 0) -> GatherState:
        """The accounting of one dataloader in the current epoch (for ``gather_for_metrics(..., state=...)``)."""
        try:
            return self.states[stage][dataloader_idx]
        except KeyError:
            raise KeyError(
                f"GatherForMetrics has not seen a {stage} batch from dataloader {dataloader_idx} this epoch."
            ) from None

    def _epoch_start(self, trainer: Trainer, stage: str) -> None:
        self.states[stage] = {}
        self._uneven[stage] = self._uneven_dataloaders(trainer, stage)
        for per_key in (self._collected, self._windows):
            for key in [k for k in per_key if k[0] == stage]:
                del per_key[key]
        for key, copies in self._copies.items():
            if key[0] == stage:
                for metric in copies.values():
                    if isinstance(metric, _STATEFUL):
                        metric.reset()

    def _uneven_dataloaders(self, trainer: Trainer, stage: str) -> set[int]:
        """The dataloaders of this epoch whose ranks run different numbers of batches, or cannot count them.

        Only shards in which every sample is real may (:attr:`GatherState.batches_may_differ`); their counts are agreed
        in one object gather, made only when there is such a dataloader (every rank reads the same kinds of
        dataloaders, so every rank decides alike) and the callback gathers outputs at all.
        """
        if not self.metrics or not is_distributed():
            return set()
        loaders = self._dataloaders(trainer, stage)
        candidates = [
            idx
            for idx, loader in enumerate(loaders)
            if GatherState.from_dataloader(loader, name=f"{stage} dataloader {idx}").batches_may_differ
        ]
        if not candidates:
            return set()
        if stage == "test":
            counts = trainer.num_test_batches
        else:
            counts = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        by_rank = values_by_rank([float(counts[idx]) for idx in candidates])
        return {
            idx
            for column, idx in enumerate(candidates)
            if any(rank[column] != by_rank[0][column] or math.isinf(rank[column]) for rank in by_rank)
        }

    def _new_state(self, trainer: Trainer, stage: str, dataloader_idx: int) -> GatherState:
        """The accounting of one dataloader for this epoch, read from it (and its batch size, for "auto" windows)."""
        loader = self._dataloader(trainer, stage, dataloader_idx)
        state = GatherState.from_dataloader(loader, name=f"{stage} dataloader {dataloader_idx}")
        self.states.setdefault(stage, {})[dataloader_idx] = state
        batch_size = getattr(loader, "batch_size", None)
        if batch_size is None and state.item_sizes is not None:  # a BatchSampler given as sampler=
            batch_size = state.item_sizes[0]
        self._loader_batch_sizes[(stage, dataloader_idx)] = (
            batch_size if isinstance(batch_size, int) and batch_size > 0 else None
        )
        return state

    def _batch_start(self, trainer: Trainer, stage: str, batch: Any, dataloader_idx: int) -> None:
        state = self.states.setdefault(stage, {}).get(dataloader_idx)
        if state is None:
            state = self._new_state(trainer, stage, dataloader_idx)
        state.begin_item(batch)
        set_current_state(state)

    def _batch_end(self, pl_module: LightningModule, stage: str, outputs: Any, dataloader_idx: int) -> None:
        if not self.metrics:
            return
        key = (stage, dataloader_idx)
        state = self.states[stage][dataloader_idx]
        problem = self._output_problem(stage, outputs, state)
        if not is_distributed():  # nothing to gather: the outputs are the global batch
            if problem is not None:
                raise StepOutputError(problem)
            self._update(
                pl_module,
                stage,
                dataloader_idx,
                _detached(outputs[self.preds_key]),
                _detached(outputs[self.target_key]),
            )
            return
        kept = (
            None
            if problem is not None
            else {"preds": _detached(outputs[self.preds_key]), "target": _detached(outputs[self.target_key])}
        )
        window = self._windows.get(key)
        if window is not None and kept is not None and not window.fits(kept):
            if dataloader_idx in self._uneven.get(stage, ()):  # a gather here would be on this rank only
                problem, kept = _changing_outputs_problem(stage), None
            else:
                self._gather_window(pl_module, stage, dataloader_idx)
                window = None
        if window is None:
            window = self._windows[key] = BatchWindow(first_sample=state.batch_start)
        batch_size = self._loader_batch_sizes.get(key)
        if self.gather_every == "auto" and key not in self._window_sizes and kept is not None and batch_size:
            # sized before any gather, from what every rank shares: the outputs' row size and the loader's batch size
            self._window_sizes[key] = batches_for_budget(self.buffer_limit, row_bytes(kept) * batch_size)
        if problem is not None:  # the other ranks gather this window with its batch: every rank raises there
            window.fail(problem)
        else:
            assert kept is not None  # kept is None exactly when there is a problem
            window.add(kept)
        if window.batches >= self._window_size(key):
            self._gather_window(pl_module, stage, dataloader_idx)

    def _window_size(self, key: tuple[str, int]) -> float:
        """Batches the open window of ``key`` holds before it is gathered (the same on every rank)."""
        if key[1] in self._uneven.get(key[0], ()):
            return float("inf")  # gathered at the end of the epoch, which every rank reaches
        if self.gather_every == "batch":
            return 1
        if self.gather_every == "epoch":
            return float("inf")
        if self.gather_every == "auto":
            return self._window_sizes.get(key, 1)  # without a loader batch size, a first window of one batch measures
        return self.gather_every

    def _gather_window(self, pl_module: LightningModule, stage: str, dataloader_idx: int) -> None:
        """Gather the open window of one dataloader (collective) and update the metrics once per batch in it."""
        key = (stage, dataloader_idx)
        window = self._windows.pop(key, None)
        if window is None:
            return
        try:
            batches = window.gather(self.states[stage][dataloader_idx], error_type=StepOutputError)
        except CallSiteMismatch as err:
            raise CallSiteMismatch(
                f"{err} GatherForMetrics gathers its outputs after the same batches on every rank (here a window of "
                f"{window.batches} batches), sized from the first batch's outputs and closed early when their shape "
                "or dtype changes; predictions or targets whose shape beyond dim 0 differs between ranks make the "
                "ranks gather at different batches: pad them in the step with "
                "lightspeed.pad_across_processes(tensor, dim=1, pad_index=...)."
            ) from None
        for outputs in batches:
            self._update(pl_module, stage, dataloader_idx, outputs["preds"], outputs["target"])
        if self.gather_every == "auto":
            self._window_sizes[key] = batches_per_window(
                self.buffer_limit, batches, torch.distributed.get_world_size(), window.batches
            )

    def _uneven_layouts(self, trainer: Trainer, stage: str) -> dict[int, Any]:
        """Per dataloader of this epoch with uneven batch counts that some rank ran a batch of: the layout of a rank's
        window, for the ranks without one (None when no rank has outputs, e.g. every step failed). A collective when
        there is such a dataloader; a rank that ran none of its batches gets its (empty) accounting here, so that
        every rank checks, gathers and logs the same dataloaders."""
        uneven = sorted(self._uneven.get(stage, ()))
        if not uneven:
            return {}
        mine = {}
        for idx in uneven:
            window = self._windows.get((stage, idx))
            mine[idx] = (window is not None, window.layout() if window is not None else None)
        by_rank = values_by_rank(mine)
        layouts = {}
        for idx in uneven:
            entries = [rank[idx] for rank in by_rank]
            if not any(has_window for has_window, _ in entries):
                continue  # no rank ran a batch of it: nothing to gather, as for any empty dataloader
            layouts[idx] = next((layout for _, layout in entries if layout is not None), None)
            if idx not in self.states[stage]:
                self._new_state(trainer, stage, idx)
        return layouts

    def _gather_uneven_window(self, pl_module: LightningModule, stage: str, dataloader_idx: int, layout: Any) -> None:
        """Gather everything of one dataloader with uneven batch counts (collective, at the end of the epoch; a rank
        without batches sends empty outputs) and update the metrics once per global batch."""
        window = self._windows.pop((stage, dataloader_idx), None) or BatchWindow(first_sample=0)
        batches = window.gather_uneven(
            self.states[stage][dataloader_idx], layout, pl_module.device, error_type=StepOutputError
        )
        for outputs in batches:
            self._update(pl_module, stage, dataloader_idx, outputs["preds"], outputs["target"])

    def _update(self, pl_module: LightningModule, stage: str, dataloader_idx: int, preds: Any, target: Any) -> None:
        """Feed globally gathered, de-duplicated predictions and targets to the metrics."""
        copies = self._metric_copies(stage, dataloader_idx, pl_module.device)
        collected = self._collected.setdefault((stage, dataloader_idx), {"preds": [], "target": []})
        if any(not isinstance(m, _STATEFUL) for m in copies.values()):
            collected["preds"].append(preds)
            collected["target"].append(target)
        if not as_leaf(preds).rows:  # a batch without samples would only trip the metrics' input checks
            return
        for metric in copies.values():
            if isinstance(metric, _STATEFUL):
                metric.update(preds, target)

    def _epoch_end(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        states = self.states.setdefault(stage, {})
        uneven_layouts = self._uneven_layouts(trainer, stage)
        limit = trainer.limit_val_batches if stage == "validate" else trainer.limit_test_batches
        complete = not trainer.sanity_checking and isinstance(limit, float) and limit == 1.0
        for idx in sorted(states):
            end_of_dataloader(states[idx], complete=complete)
        if not self.metrics:
            return
        for idx in sorted(states):
            if idx in uneven_layouts:
                self._gather_uneven_window(pl_module, stage, idx, uneven_layouts[idx])
            else:
                self._gather_window(pl_module, stage, idx)
        results: dict[str, Any] = {}
        several = len(self._dataloaders(trainer, stage)) > 1
        for idx in sorted(states):
            copies = self._metric_copies(stage, idx, pl_module.device)
            collected = self._collected.get((stage, idx), {"preds": [], "target": []})
            for name, metric in copies.items():
                if isinstance(metric, _STATEFUL):
                    value = metric.compute()
                    metric.reset()
                else:
                    value = metric(concat_samples(collected["preds"]), concat_samples(collected["target"]))
                suffix = f"/dataloader_idx_{idx}" if several else ""
                for log_name, log_value in _named_values(f"{self.prefixes[stage]}{name}", value, suffix):
                    results[log_name] = log_value
                    self._silence_sync_dist_hint(log_name)
                    pl_module.log(
                        log_name, log_value, sync_dist=False, add_dataloader_idx=False, on_step=False, on_epoch=True
                    )
        self.results[stage] = results

    def _metric_copies(self, stage: str, dataloader_idx: int, device: torch.device) -> dict[str, _MetricLike]:
        key = (stage, dataloader_idx)
        if key not in self._copies:
            copies: dict[str, _MetricLike] = {}
            for name, metric in self.metrics.items():
                if isinstance(metric, _STATEFUL):
                    metric = copy.deepcopy(metric).to(device)
                    _disable_sync(metric)
                copies[name] = metric
            self._copies[key] = copies
        return self._copies[key]

    @staticmethod
    def _dataloaders(trainer: Trainer, stage: str) -> list[Any]:
        loaders = trainer.val_dataloaders if stage == "validate" else trainer.test_dataloaders
        if loaders is None:
            return []
        return CombinedLoader(loaders, mode="sequential").flattened

    def _dataloader(self, trainer: Trainer, stage: str, dataloader_idx: int) -> Any:
        loaders = self._dataloaders(trainer, stage)
        if dataloader_idx >= len(loaders):
            raise RuntimeError(
                f"GatherForMetrics: the trainer reports no {stage} dataloader {dataloader_idx} (it has {len(loaders)})."
            )
        return loaders[dataloader_idx]

    def _output_problem(self, stage: str, outputs: Any, state: GatherState) -> str | None:
        """Why ``outputs`` lacks the predictions or targets, or holds them for other than the batch's samples (and
        what to change); None when both are there, one row per sample."""
        step = "validation_step" if stage == "validate" else "test_step"
        missing = [k for k in (self.preds_key, self.target_key) if not isinstance(outputs, Mapping) or k not in outputs]
        if not missing:
            for name in (self.preds_key, self.target_key):
                value = outputs[name]
                rows = as_leaf(value).rows
                if rows != state.batch_size:
                    described = f"{rows} rows on dim 0" if rows is not None else _kind_of(value)
                    return (
                        f"GatherForMetrics: {step} returned {name!r} with {described}, but the batch has "
                        f"{state.batch_size} samples. Return one row per sample (dim 0 = the batch; e.g. "
                        "preds.argmax(-1) of [batch, classes] logits), so that the sampler's padding can be dropped."
                    )
            return None
        returned = (
            f"a dict with keys {sorted(map(str, outputs))}"
            if isinstance(outputs, Mapping)
            else repr(type(outputs).__name__)
        )
        return (
            f"GatherForMetrics reads {self.preds_key!r} and {self.target_key!r} from what {step} returns, but it "
            f"returned {returned} (missing {missing}). Return {{{self.preds_key!r}: ..., {self.target_key!r}: ...}} "
            f"from {step}, or pass GatherForMetrics(..., preds_key=..., target_key=...)."
        )

    def _silence_sync_dist_hint(self, name: str) -> None:
        """Lightning suggests ``sync_dist=True`` for epoch values logged without it; ``name`` is global already.

        The filter matches that hint for this exact name only (the user's own values still get it) and is removed
        when the Trainer run ends.
        """
        if name in self._silenced:
            return
        hint = f"It is recommended to use `self.log({name!r}, ..., sync_dist=True)`"
        warnings.filterwarnings("ignore", message=re.escape(hint), category=PossibleUserWarning)
        self._silenced[name] = warnings.filters[0]

    def _restore_warnings(self) -> None:
        if not self._silenced:
            return
        ours = list(self._silenced.values())
        warnings.filters[:] = [f for f in warnings.filters if not any(f is o for o in ours)]  # type: ignore[index]
        mutated = getattr(warnings, "_filters_mutated", None)  # drops cached decisions (Python <= 3.13)
        if mutated is not None:
            mutated()
        self._silenced.clear()

    def _clear_context(self) -> None:
        state = current_state()
        if state is not None and any(state is s for states in self.states.values() for s in states.values()):
            set_current_state(None)


def _changing_outputs_problem(stage: str) -> str:
    step = "validation_step" if stage == "validate" else "test_step"
    return (
        f"GatherForMetrics: {step} returned predictions or targets whose dtype or shape beyond dim 0 changed between "
        "batches of a dataloader whose ranks run different numbers of batches; its outputs are gathered once at the "
        "end of the epoch, so they must keep one dtype and shape: pad them to a fixed size in the step."
    )


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


def _named_values(name: str, value: Any, suffix: str) -> list[tuple[str, Any]]:
    if isinstance(value, Mapping):  # e.g. a MetricCollection
        return [(f"{name}/{key}{suffix}", _loggable(v)) for key, v in value.items()]
    return [(f"{name}{suffix}", _loggable(value))]


def _loggable(value: Any) -> Any:
    """Lightning logs floating values; counts come back as float64 so they stay exact."""
    tensor = torch.as_tensor(value)
    return tensor if tensor.is_floating_point() else tensor.to(torch.float64)
