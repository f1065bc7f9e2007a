"""The recompilation alarm on PJRT's CPU device: a tiny sequence model trained with ``accelerator="xla"`` on batches
of varying sequence length warns once, naming the changed shapes and torch_xla's compile count; padded to buckets
with ``lightspeed.xla.bucket_collate`` it compiles nothing more once every bucket has been seen, and does not warn.

Each test's model has its own hidden size, so that no test finds its graphs already compiled by another (torch_xla
caches compiled graphs per process by their ops and shapes).

Needs torch_xla: runs in the XLA environment (``PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -m xla
tests/plugins/test_xla*.py``); skipped elsewhere.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
pytest.importorskip(
    "torch_xla",
    reason="needs torch_xla; run scripts/setup_xla.sh and test in .venv-xla "
    "(pytest -m xla tests/plugins tests/strategies)",
)

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch_xla.debug.metrics as metrics  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightspeed  # noqa: E402,F401  (registers accelerator="xla")
from _support.trainers import quiet_trainer  # noqa: E402
from lightspeed.strategies import SingleDeviceXLAExactStrategy  # noqa: E402
from lightspeed.xla import XLARecompilationWarning, bucket_collate  # noqa: E402

pytestmark = pytest.mark.xla

VOCAB = 32
# the sequence lengths of each batch's two samples: the batch's longest is 5, 12, 5, 9, 9, 12, 3, 9
LENGTHS = [(5, 3), (12, 4), (5, 5), (9, 2), (9, 9), (12, 1), (3, 2), (7, 9)]
BUCKETS = (8, 16)
# every length its own bucket: batches padded to their longest sample only, as without bucketing
PAD_TO_LONGEST = tuple(range(1, 17))


def _samples() -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    return [
        {"input_ids": torch.randint(1, VOCAB, (n,), generator=gen).tolist(), "labels": i % 2}
        for pair in LENGTHS
        for i, n in enumerate(pair)
    ]


class SequenceClassifier(L.LightningModule):
    """Mean of the masked token embeddings, then a linear layer; plain SGD (no optimizer state)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.head = nn.Linear(hidden, 2)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        mask = batch["attention_mask"].unsqueeze(-1).to(torch.float32)
        pooled = (self.embed(batch["input_ids"]) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return nn.functional.cross_entropy(self.head(pooled), batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _compile_count() -> int:
    data = metrics.metric_data("CompileTime")
    return 0 if data is None else int(data[0])


class CompileCounts(L.Callback):
    """torch_xla's compile count at the start of every training batch (before the strategy's alarm reads it, with
    nothing run in between) and at the end of the fit, and each batch's input shape."""

    def __init__(self) -> None:
        self.at_start: list[int] = []
        self.shapes: list[tuple[int, ...]] = []
        self.at_end: int | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.at_start.append(_compile_count())
        self.shapes.append(tuple(batch["input_ids"].shape))

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.at_end = _compile_count()


def _fit(hidden: int, collate: Any, **trainer_kwargs: Any) -> tuple[L.Trainer, CompileCounts, list[str]]:
    counts = CompileCounts()
    trainer = quiet_trainer(
        accelerator="xla",
        devices=1,
        max_epochs=1,
        callbacks=[counts],
        **trainer_kwargs,
    )
    loader = DataLoader(_samples(), batch_size=2, shuffle=False, collate_fn=collate)  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(SequenceClassifier(hidden), loader)
    alarms = [str(w.message) for w in caught if issubclass(w.category, XLARecompilationWarning)]
    return trainer, counts, alarms


def test_a_new_sequence_length_after_the_warm_up_warns_once_with_the_change_and_the_compile_count() -> None:
    trainer, counts, alarms = _fit(hidden=8, collate=bucket_collate(PAD_TO_LONGEST))
    assert [shape[1] for shape in counts.shapes] == [5, 12, 5, 9, 9, 12, 3, 9]
    # step 3 brings the first unseen length after the two warm-up steps; its compilations show at step 4's start
    new, total = counts.at_start[4] - counts.at_start[3], counts.at_start[4]
    assert new > 0
    assert alarms == [
        "torch_xla compiled again after the warm-up: step 3 (counted from 0; the first 2 are warm-up) has other input"
        " shapes than the step before: batch['input_ids'] (2, 5) -> (2, 9); batch['attention_mask'] (2, 5) -> (2, 9)."
        f" It compiled {new} new graph{'s' if new > 1 else ''}, {total} in this process so far (the CompileTime count"
        " of torch_xla.debug.metrics): every new input shape or dtype compiles again, which stalls training. Pad every"
        " batch to one of a few fixed shapes: lightspeed.xla.pad_to_bucket(batch, buckets=(128, 256, 512)) on the"
        " collated batch, or DataLoader(..., collate_fn=lightspeed.xla.bucket_collate((128, 256, 512))). This warning"
        " is shown once."
    ]
    # later unseen lengths (3 at step 6) compile again: counted, not warned about again
    assert counts.at_start[7] > counts.at_start[6]
    alarm = trainer.strategy.recompilation  # type: ignore[attr-defined]
    assert alarm is not None and alarm.recompiled_steps == [3, 6]


def test_padded_to_buckets_nothing_compiles_once_every_bucket_was_seen() -> None:
    trainer, counts, alarms = _fit(hidden=10, collate=bucket_collate(BUCKETS))
    assert [shape[1] for shape in counts.shapes] == [8, 16, 8, 16, 16, 16, 8, 16]
    assert counts.at_end is not None
    # steps 0 and 1 saw both buckets; what they compiled is counted by step 2's start, and nothing after that
    assert counts.at_start[2] > counts.at_start[0]
    assert counts.at_start[2:] + [counts.at_end] == [counts.at_start[2]] * 7
    assert alarms == []
    assert trainer.strategy.recompilation.recompiled_steps == []  # type: ignore[attr-defined]


def test_the_alarm_can_be_turned_off() -> None:
    strategy = SingleDeviceXLAExactStrategy(recompilation_alarm=False)
    trainer, counts, alarms = _fit(hidden=12, collate=bucket_collate(PAD_TO_LONGEST), strategy=strategy)
    assert counts.at_start[4] > counts.at_start[3]  # it did compile again
    assert alarms == [] and strategy.recompilation is None


def test_the_alarm_in_a_loop_of_ones_own() -> None:
    """What a Fabric loop (or a plain torch_xla one) calls: ``observe`` at every step's start, ``close`` after."""
    import torch_xla

    from lightspeed.xla import RecompilationAlarm

    device = torch_xla.device()
    layer = nn.Linear(7, 1).to(device)
    messages: list[str] = []
    alarm = RecompilationAlarm(warmup_steps=2, warn=messages.append)
    starts = []
    for rows in [4, 4, 4, 6, 6]:
        batch = torch.ones(rows, 7).to(device)
        starts.append(_compile_count())
        alarm.observe(batch)
        layer(batch).sum().backward()
        torch_xla.sync()
    alarm.close()
    new, total = _compile_count() - starts[3], _compile_count()
    assert alarm.recompiled_steps == [3]
    assert messages == [
        "torch_xla compiled again after the warm-up: step 3 (counted from 0; the first 2 are warm-up) has other input"
        f" shapes than the step before: batch (4, 7) -> (6, 7). It compiled {new} new graph{'s' if new > 1 else ''},"
        f" {total} in this process so far (the CompileTime count of torch_xla.debug.metrics): every new input shape"
        " or dtype compiles again, which stalls training. Only the batch size changed: the last batch of an epoch is"
        " smaller unless the DataLoader drops it (DataLoader(..., drop_last=True)). This warning is shown once."
    ]
