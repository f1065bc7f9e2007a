"""``RecompilationAlarm`` with fake compile/execute counts (the main suite has no torch_xla): which step is blamed,
the warm-up, the message, one warning only, pauses. The real thing on PJRT's CPU device:
``tests/plugins/test_xla_recompilation.py``."""

from __future__ import annotations

import importlib.util
import re
import warnings

import pytest
import torch

import lightspeed
from lightspeed.core.xla.recompilation import batch_signature, describe_changes
from lightspeed.xla import RecompilationAlarm, XLARecompilationWarning


class FakeXLA:
    """Counts like torch_xla's metrics: ``run(compiled)`` executes one graph, compiling it first if asked."""

    def __init__(self) -> None:
        self.compiled = 0
        self.executed = 0

    def counts(self) -> tuple[int, int]:
        return self.compiled, self.executed

    def run(self, compiles: int = 0) -> None:
        self.compiled += compiles
        self.executed += 1


def _ids(length: int, batch_size: int = 2, dtype: torch.dtype = torch.long) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.zeros(batch_size, length, dtype=dtype), "labels": torch.zeros(batch_size)}


def _alarm(xla: FakeXLA, **kwargs: object) -> tuple[RecompilationAlarm, list[str]]:
    messages: list[str] = []
    return RecompilationAlarm(warn=messages.append, counts=xla.counts, **kwargs), messages  # type: ignore[arg-type]


def _message(
    step: int, changes: str, new: int, total: int, warmup: int = 2, what: str = "shapes", advice: str = ""
) -> str:
    advice = advice or (
        "Pad every batch to one of a few fixed shapes: lightspeed.xla.pad_to_bucket(batch, buckets=(128, 256, 512))"
        " on the collated batch, or DataLoader(..., collate_fn=lightspeed.xla.bucket_collate((128, 256, 512)))."
    )
    graphs = "graph" if new == 1 else "graphs"
    return (
        f"torch_xla compiled again after the warm-up: step {step} (counted from 0; the first {warmup} are warm-up)"
        f" has other input {what} than the step before: {changes}. It compiled {new} new {graphs}, {total} in this"
        " process so far (the CompileTime count of torch_xla.debug.metrics): every new input shape or dtype compiles"
        f" again, which stalls training. {advice} This warning is shown once."
    )


def test_public_names() -> None:
    assert lightspeed.xla.RecompilationAlarm is RecompilationAlarm
    assert issubclass(XLARecompilationWarning, UserWarning)


def test_a_new_sequence_length_after_the_warm_up_is_reported_once() -> None:
    xla = FakeXLA()
    alarm, messages = _alarm(xla)
    compiles = {5: 3, 9: 2, 12: 2}  # graphs the first step of each length compiles
    seen: set[int] = set()
    for length in [5, 5, 5, 9, 9, 12, 5]:
        alarm.observe(_ids(length))
        xla.run(0 if length in seen else compiles[length])  # the step's optimizer step syncs
        seen.add(length)
    alarm.close()
    assert messages == [
        _message(3, "batch['input_ids'] (2, 5) -> (2, 9)", new=2, total=5),
    ]
    assert alarm.recompiled_steps == [3, 5]  # the second is counted, not warned about again
    assert alarm.steps == 7


def test_compilations_in_the_warm_up_are_expected() -> None:
    xla = FakeXLA()
    alarm, messages = _alarm(xla, warmup_steps=3)
    for step, length in enumerate([4, 6, 8, 8]):
        alarm.observe(_ids(length))
        xla.run(2 if step < 3 else 0)
    alarm.close()
    assert messages == [] and alarm.recompiled_steps == []


def test_a_compilation_without_changed_inputs_is_not_blamed_on_the_batch() -> None:
    xla = FakeXLA()
    alarm, messages = _alarm(xla)
    for step in range(6):
        alarm.observe(_ids(8))
        xla.run(1 if step in (0, 4) else 0)  # e.g. the first optimizer step of an accumulation window
    alarm.close()
    assert messages == []


def test_steps_without_an_execution_are_compiled_with_the_next_one() -> None:
    """Accumulation on one device: micro-batches are only executed with the window's optimizer step."""
    xla = FakeXLA()
    alarm, messages = _alarm(xla)
    for step, length in enumerate([8, 8, 8, 8, 8, 16, 16, 16, 16]):
        alarm.observe(_ids(length))
        if step % 3 == 2:  # the window's last micro-batch: its sync runs the whole window
            xla.run(2 if step in (2, 5) else 0)
    alarm.close()
    assert messages == [_message(5, "batch['input_ids'] (2, 8) -> (2, 16)", new=2, total=4)]


def test_the_last_step_is_counted_by_close() -> None:
    xla = FakeXLA()
    alarm, messages = _alarm(xla)
    for length in [8, 8, 8]:
        alarm.observe(_ids(length))
        xla.run()
    alarm.observe(_ids(8, batch_size=1))  # the short last batch of the epoch
    xla.run(1)
    assert messages == []
    alarm.close()
    assert messages == [
        _message(
            3,
            "batch['input_ids'] (2, 8) -> (1, 8); batch['labels'] (2,) -> (1,)",
            new=1,
            total=1,
            advice="Only the batch size changed: the last batch of an epoch is smaller unless the DataLoader drops it"
            " (DataLoader(..., drop_last=True)).",
        )
    ]


def test_validation_compilations_are_ignored_after_a_pause() -> None:
    xla = FakeXLA()
    alarm, messages = _alarm(xla)
    for length in [8, 8, 8, 8]:
        alarm.observe(_ids(length))
        xla.run()
    alarm.pause()
    xla.run(3)  # the validation loop compiles its graphs
    alarm.observe(_ids(8))
    xla.run()
    alarm.observe(_ids(16))  # a real change after validation is still found
    xla.run(1)
    alarm.close()
    assert messages == [_message(5, "batch['input_ids'] (2, 8) -> (2, 16)", new=1, total=4)]


def test_cleared_metrics_reset_the_count() -> None:
    xla = FakeXLA()
    alarm, messages = _alarm(xla)
    for length in [8, 8, 8]:
        alarm.observe(_ids(length))
        xla.run(1)
    xla.compiled = xla.executed = 0  # torch_xla.debug.metrics.clear_all()
    alarm.observe(_ids(16))
    alarm.close()
    assert messages == []


def test_dtype_changes_and_added_tensors_are_named() -> None:
    xla = FakeXLA()
    alarm, messages = _alarm(xla, warmup_steps=0)
    alarm.observe({"x": torch.zeros(2, 3)})
    xla.run(1)
    alarm.observe({"x": torch.zeros(2, 3, dtype=torch.bfloat16), "mask": torch.ones(2, 3, dtype=torch.bool)})
    xla.run(1)
    alarm.close()
    assert messages == [
        _message(
            1,
            "batch['x'] float32 -> bfloat16; batch['mask'] absent -> (2, 3) bool",
            new=1,
            total=2,
            warmup=0,
            what="shapes and dtypes",
            advice="Pad every batch to one of a few fixed shapes: lightspeed.xla.pad_to_bucket(batch, buckets=(128,"
            " 256, 512)) on the collated batch, or DataLoader(..., collate_fn=lightspeed.xla.bucket_collate((128,"
            " 256, 512))). Give every batch the same dtypes.",
        )
    ]


def test_signatures_of_nested_batches() -> None:
    batch = (torch.zeros(2, 5), {"mask": torch.ones(2, 5, dtype=torch.bool)}, "meta")
    assert batch_signature(batch) == {
        "batch[0]": ((2, 5), torch.float32),
        "batch[1]['mask']": ((2, 5), torch.bool),
    }
    assert describe_changes(batch_signature(batch), batch_signature(batch)) == []
    many = {f"t{i}": torch.zeros(1, i + 1) for i in range(6)}
    more = {f"t{i}": torch.zeros(1, i + 2) for i in range(6)}
    assert len(describe_changes(batch_signature(many), batch_signature(more))) == 6


def test_the_message_lists_four_changes_and_counts_the_rest() -> None:
    xla = FakeXLA()
    alarm, messages = _alarm(xla, warmup_steps=0)
    alarm.observe({f"t{i}": torch.zeros(1, 2) for i in range(6)})
    xla.run(1)
    alarm.observe({f"t{i}": torch.zeros(1, 3) for i in range(6)})
    xla.run(1)
    alarm.close()
    assert "batch['t3'] (1, 2) -> (1, 3); and 2 more. It compiled 1 new graph" in messages[0]


def test_the_default_warning_category() -> None:
    xla = FakeXLA()
    alarm = RecompilationAlarm(warmup_steps=0, counts=xla.counts)
    alarm.observe(_ids(4))
    alarm.observe(_ids(8))
    xla.run(1)
    with pytest.warns(XLARecompilationWarning) as record:
        alarm.close()
    assert len(record) == 1 and str(record[0].message) == alarm.message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        alarm.observe(_ids(16))
        xla.run(1)
        alarm.close()  # once


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_warmup_steps_must_be_a_whole_number(bad: object) -> None:
    message = (
        "recompilation warm-up steps must be a whole number >= 0 (the first steps, whose compilations are expected),"
        f" got {bad!r}."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        RecompilationAlarm(warmup_steps=bad, counts=FakeXLA().counts)  # type: ignore[arg-type]


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed here")
def test_without_torch_xla_the_alarm_says_so() -> None:
    message = (
        "RecompilationAlarm reads torch_xla's compile metrics, but torch_xla is not installed. Use it in a run on an"
        " XLA device (pip install torch_xla matching your torch version)."
    )
    with pytest.raises(ModuleNotFoundError, match=f"^{re.escape(message)}$"):
        RecompilationAlarm()
