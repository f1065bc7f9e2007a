"""``GatherForMetrics``: validation/test metrics over exactly the real samples, equal to the single-process value.

The callback holds Lightning's hooks and logging; the work is core's, shared with Fabric loops
(:func:`lightspeed.exact_metrics`): one :class:`~lightspeed.core.gather.metrics.LoaderMetrics` record per evaluation
dataloader. Its :class:`~lightspeed.core.gather.accounting.GatherState` (read from the sampler and dataset at the first
batch of each epoch) is made the current state around every batch, so
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

import re
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from typing_extensions import override

from lightspeed.core.gather.accounting import GatherState, current_state, set_current_state
from lightspeed.core.gather.api import end_of_dataloader
from lightspeed.core.gather.metrics import (
    GatherEvery,
    LoaderMetrics,
    MetricLike,
    WindowPolicy,
    checked_metrics,
    uneven_dataloaders,
    uneven_layouts,
)

__all__ = ["GatherForMetrics"]

#: evaluation stages each Trainer entry point runs
_RUN_STAGES = {"fit": ("validate",), "validate": ("validate",), "test": ("test",)}
_STEPS = {"validate": "validation_step", "test": "test_step"}


class GatherForMetrics(Callback):
    """Exact distributed evaluation metrics (see the module docstring).

    Args:
        metrics: ``{"acc": MulticlassAccuracy(10), "f1": some_fn}``; ``None`` to only track the dataloaders for
            hand-written ``gather_for_metrics`` calls.
        preds_key: the key of the predictions in the dict that ``validation_step`` / ``test_step`` returns.
        target_key: the key of the targets in that dict.
        val_prefix: the prefix of the names logged in validation (``"val/"``: ``val/acc``).
        test_prefix: the prefix of the names logged in test.
        gather_every: how many consecutive batches one gather carries: ``"auto"`` (default) sizes the window so
            that a rank keeps about ``buffer_limit`` bytes of outputs; an int N gathers every N batches;
            ``"batch"`` every batch (the metrics are updated right after each batch); ``"epoch"`` once at epoch
            end (memory for the epoch's outputs). A batch whose outputs change dtype or trailing shape closes the
            window before it. Whatever the window, the metrics are updated once per batch with the same data.
        buffer_limit: bytes of outputs per rank that ``"auto"`` aims at (an int or a size such as ``"4MiB"``).
    """

    def __init__(
        self,
        metrics: Mapping[str, MetricLike] | None = None,
        preds_key: str = "preds",
        target_key: str = "target",
        val_prefix: str = "val/",
        test_prefix: str = "test/",
        gather_every: GatherEvery = "auto",
        buffer_limit: int | str = "4MiB",
    ) -> None:
        self.metrics: dict[str, MetricLike] = checked_metrics(metrics, "GatherForMetrics")
        self.preds_key, self.target_key = preds_key, target_key
        self.policy = WindowPolicy.parse(gather_every, buffer_limit, "GatherForMetrics")
        self.gather_every, self.buffer_limit = self.policy.gather_every, self.policy.buffer_limit
        self.prefixes = {"validate": val_prefix, "test": test_prefix}
        self.states: dict[str, dict[int, GatherState]] = {}
        self.results: dict[str, dict[str, Any]] = {}  # stage -> logged name -> value, from the last epoch
        #: per Trainer run (re-created in setup, since a new run may be on another device): one record per
        #: (stage, dataloader_idx) holding its window, its metric copies and what was gathered for plain callables
        self._records: dict[tuple[str, int], LoaderMetrics] = {}
        self._silenced: dict[str, Any] = {}  # logged name -> the warnings filter this run installed for it
        self._sequences: Any = None  # the strategy's sequence parallelism, when it splits sequences

    # hooks ------------------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        sequences = getattr(trainer.strategy, "sequence_parallel", None)
        self._sequences = sequences if sequences is not None and sequences.enabled else None
        self._records = {}  # a new run may be on another device and must not see the previous run's samples
        for run_stage in _RUN_STAGES.get(stage, ()):
            self.states.pop(run_stage, None)
            self.results.pop(run_stage, None)

    # The validation and test loops run the same hooks; each reads its stage from the trainer (the test hooks are the
    # validation hooks under their own names).

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_start(trainer, _stage(trainer))

    @override
    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._batch_start(trainer, _stage(trainer), batch, dataloader_idx)

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
        self._batch_end(pl_module, _stage(trainer), outputs, dataloader_idx)

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_end(trainer, pl_module, _stage(trainer))

    on_test_epoch_start = on_validation_epoch_start
    on_test_batch_start = on_validation_batch_start
    on_test_batch_end = on_validation_batch_end
    on_test_epoch_end = on_validation_epoch_end

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
        loaders = self._dataloaders(trainer, stage)
        records = self._stage_records(stage, len(loaders))
        uneven = self._uneven_dataloaders(trainer, stage, records, loaders)
        for record in records:
            record.start_epoch(uneven=record.name in uneven)

    def _stage_records(self, stage: str, count: int) -> list[LoaderMetrics]:
        """The records of the ``count`` dataloaders evaluated in ``stage``, by index."""
        return [self._record(stage, idx) for idx in range(count)]

    def _record(self, stage: str, dataloader_idx: int) -> LoaderMetrics:
        key = (stage, dataloader_idx)
        if key not in self._records:
            self._records[key] = LoaderMetrics(
                self.metrics,
                self.policy,
                f"{stage} dataloader {dataloader_idx}",
                "GatherForMetrics",
                _STEPS[stage],
                (self.preds_key, self.target_key),
                self._sequences,
            )
        return self._records[key]

    def _uneven_dataloaders(
        self, trainer: Trainer, stage: str, records: list[LoaderMetrics], loaders: list[Any]
    ) -> set[str]:
        """The names of this epoch's dataloaders whose ranks run different numbers of batches (a collective only when
        the callback gathers outputs at all and some dataloader may)."""
        if not self.metrics:
            return set()
        if stage == "test":
            counts = trainer.num_test_batches
        else:
            counts = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        names = [record.name for record in records]
        return uneven_dataloaders(
            dict(zip(names, loaders, strict=True)),
            dict(zip(names, counts, strict=False)),
            self._sequences.size if self._sequences is not None else None,
        )

    def _new_state(self, trainer: Trainer, stage: str, dataloader_idx: int) -> GatherState:
        """The accounting of one dataloader for this epoch, read from it."""
        state = self._record(stage, dataloader_idx).read_dataloader(self._dataloader(trainer, stage, dataloader_idx))
        self.states.setdefault(stage, {})[dataloader_idx] = state
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
        problem = self._output_problem(stage, outputs)
        pair = None if problem is not None else (outputs[self.preds_key], outputs[self.target_key])
        self._record(stage, dataloader_idx).add_step_outputs(pair, problem, pl_module.device)

    def _epoch_end(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        states = self.states.setdefault(stage, {})
        records = self._stage_records(stage, len(self._dataloaders(trainer, stage)))
        layouts = uneven_layouts(records)
        for idx, record in enumerate(records):
            if record.name in layouts and idx not in states:  # a rank that ran none of its batches joins the gather
                self._new_state(trainer, stage, idx)
        limit = trainer.limit_val_batches if stage == "validate" else trainer.limit_test_batches
        complete = not trainer.sanity_checking and isinstance(limit, float) and limit == 1.0
        for idx in sorted(states):
            end_of_dataloader(states[idx], complete=complete)
        if not self.metrics:
            return
        for idx in sorted(states):
            self._records[(stage, idx)].gather_rest(pl_module.device, layouts)
        results: dict[str, Any] = {}
        suffix_for = len(records) > 1
        for idx in sorted(states):
            suffix = f"/dataloader_idx_{idx}" if suffix_for else ""
            for name, value in self._records[(stage, idx)].compute(pl_module.device).items():
                for log_name, log_value in _named_values(f"{self.prefixes[stage]}{name}", value, suffix):
                    results[log_name] = log_value
                    self._silence_sync_dist_hint(log_name)
                    pl_module.log(
                        log_name, log_value, sync_dist=False, add_dataloader_idx=False, on_step=False, on_epoch=True
                    )
        self.results[stage] = results

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

    def _output_problem(self, stage: str, outputs: Any) -> str | None:
        """Why ``outputs`` lacks the predictions or targets (and what to change); None when both are there."""
        missing = [k for k in (self.preds_key, self.target_key) if not isinstance(outputs, Mapping) or k not in outputs]
        if not missing:
            return None
        step = _STEPS[stage]
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


def _stage(trainer: Trainer) -> str:
    """The evaluation stage the trainer runs now, as the callback names it."""
    return "test" if trainer.testing else "validate"


def _named_values(name: str, value: Any, suffix: str) -> list[tuple[str, Any]]:
    if isinstance(value, Mapping):  # e.g. a MetricCollection
        return [(f"{name}/{key}{suffix}", _loggable(v)) for key, v in value.items()]
    return [(f"{name}{suffix}", _loggable(value))]


def _loggable(value: Any) -> Any:
    """Lightning logs floating values; counts come back as float64 so they stay exact."""
    tensor = torch.as_tensor(value)
    return tensor if tensor.is_floating_point() else tensor.to(torch.float64)
