"""``lightspeed.exact_metrics`` and its per-dataloader record on one process: the values equal the metrics computed
directly, the metrics passed in are not updated, and bad input fails with a message that says what to change.
(Several ranks: ``tests/fabric/test_fabric.py`` and ``tests/fabric/test_fabric_uneven_evaluation.py``.)"""

from __future__ import annotations

import pytest
import torch
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

import lightspeed
from lightspeed.core.errors import StepOutputError

CLASSES = 4


def loader() -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(11, CLASSES, generator=gen)
    target = torch.randint(0, CLASSES, (11,), generator=gen)
    return DataLoader(TensorDataset(logits, target), batch_size=3)


def metrics() -> dict:
    return {
        "acc": torchmetrics.classification.MulticlassAccuracy(CLASSES, average="micro"),
        "both": torchmetrics.MetricCollection({"f1": torchmetrics.classification.MulticlassF1Score(CLASSES)}),
        "rows": lambda preds, target: len(preds),
    }


@pytest.mark.parametrize("gather_every", ["auto", "batch", 2, "epoch"])
def test_exact_metrics_on_one_process_equal_the_metrics_computed_directly(gather_every: object) -> None:
    given = metrics()
    values = lightspeed.exact_metrics(
        loader(), lambda batch: (batch[0].argmax(-1), batch[1]), given, gather_every=gather_every
    )
    logits, target = loader().dataset.tensors
    preds = logits.argmax(-1)
    expected = metrics()
    assert values["acc"] == expected["acc"](preds, target)
    assert values["both"]["f1"] == expected["both"](preds, target)["f1"]
    assert values["rows"] == 11
    assert int(given["acc"].tp.sum() + given["acc"].fn.sum()) == 0  # copies are updated, never the metric passed in


def test_a_step_that_returns_other_than_a_pair_is_named() -> None:
    with pytest.raises(
        StepOutputError,
        match=r"^lightspeed\.exact_metrics: step\(batch\) returned a dict; return \(preds, target\)\.$",
    ):
        lightspeed.exact_metrics(loader(), lambda batch: {"preds": batch[0]}, metrics())


def test_outputs_with_other_than_one_row_per_sample_are_named() -> None:
    with pytest.raises(
        StepOutputError,
        match=r"^lightspeed\.exact_metrics: step\(batch\) returned 'preds' with 6 rows on dim 0, but the batch has 3 "
        r"samples\. Return one row per sample",
    ):
        lightspeed.exact_metrics(loader(), lambda batch: (batch[0].repeat(2, 1), batch[1]), metrics())


def test_bad_arguments_say_what_to_pass() -> None:
    with pytest.raises(ValueError, match=r"^lightspeed\.exact_metrics\(gather_every=0\): use 'auto', 'batch'"):
        lightspeed.exact_metrics(loader(), lambda batch: batch, metrics(), gather_every=0)
    with pytest.raises(TypeError, match=r"^lightspeed\.exact_metrics expects a dict of metrics .* wrap it"):
        lightspeed.exact_metrics(loader(), lambda batch: batch, torchmetrics.MeanMetric())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"lightspeed\.exact_metrics\(buffer_limit=\.\.\.\)"):
        lightspeed.exact_metrics(loader(), lambda batch: batch, metrics(), buffer_limit="lots")
