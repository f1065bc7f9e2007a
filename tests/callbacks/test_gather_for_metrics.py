"""GatherForMetrics on a single device (in this process) and its input checks; Lightning's sampler wrappers."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSamplerWrapper
from torch.utils.data import DataLoader, SubsetRandomSampler

import lightspeed
from _support.trainers import quiet_trainer
from lightspeed.callbacks import GatherForMetrics
from lightspeed.core.errors import GatherError, StepOutputError
from lightspeed.core.gather import GatherState

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core" / "gather" / "scripts"))
from gather_data import NUM_CLASSES, MapData, model, reference  # noqa: E402


class Module(L.LightningModule):
    def __init__(self, returns: str = "dict") -> None:
        super().__init__()
        self.net = model()
        self.returns = returns
        self.by_hand: list = []

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y, idx = batch
        preds = self.net(x).argmax(-1)
        self.by_hand.append(lightspeed.gather_for_metrics((idx, [int(i) for i in idx])))
        if self.returns == "dict":
            return {"preds": preds, "target": y}
        if self.returns == "wrong_keys":
            return {"logits": preds, "y": y}
        if self.returns == "per_token":  # two rows per sample: dim 0 is not the batch
            return {"preds": preds.repeat(2), "target": y}
        if self.returns == "scalar":
            return {"preds": preds, "target": y.sum()}
        return None

    test_step = validation_step


class RowCount(torchmetrics.Metric):
    """Counts the rows it is updated with; every update call (on any copy) is recorded in ``RowCount.calls``."""

    calls: list = []  # class-level, so deep copies append to the same list: (id of the object, rows)

    def __init__(self) -> None:
        super().__init__()
        self.add_state("rows", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        RowCount.calls.append((id(self), len(preds)))
        self.rows += len(preds)

    def compute(self) -> torch.Tensor:
        return self.rows


def trainer(callback: GatherForMetrics, accelerator: str = "cpu", **kwargs) -> L.Trainer:
    return quiet_trainer(
        accelerator=accelerator,
        devices=1,
        callbacks=[callback],
        **kwargs,
    )


def test_single_device_metrics_equal_reference_and_gathers_are_no_ops():
    n = 11
    ref = reference(n)
    callback = GatherForMetrics(
        {
            "acc": torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro"),
            "both": torchmetrics.MetricCollection({"p": torchmetrics.classification.MulticlassPrecision(NUM_CLASSES)}),
            "n_correct": lambda preds, target: (preds == target).sum(),
        },
        val_prefix="eval/",
    )
    module = Module()
    loaders = [DataLoader(MapData(n), batch_size=4), DataLoader(MapData(5), batch_size=2)]
    metrics = trainer(callback).validate(module, dataloaders=loaders, verbose=False)[0]
    expected_acc = torchmetrics.functional.accuracy(
        ref["preds"], ref["target"], "multiclass", num_classes=NUM_CLASSES, average="micro"
    )
    assert metrics["eval/acc/dataloader_idx_0"] == expected_acc.item()
    assert metrics["eval/n_correct/dataloader_idx_0"] == int((ref["preds"] == ref["target"]).sum())
    expected_p = torchmetrics.functional.precision(
        ref["preds"], ref["target"], "multiclass", num_classes=NUM_CLASSES, average="macro"
    )
    assert metrics["eval/both/p/dataloader_idx_0"] == expected_p.item()
    assert "eval/acc/dataloader_idx_1" in metrics
    first_idx, first_list = module.by_hand[0]
    assert first_idx.tolist() == [0, 1, 2, 3] and first_list == [0, 1, 2, 3]
    assert callback.state_for("validate", 0).real_total == n and callback.state_for("validate", 1).real_total == 5


def test_test_stage_logs_with_test_prefix_and_resets_each_epoch():
    callback = GatherForMetrics({"acc": torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")})
    tr = trainer(callback)
    ref = reference(6)
    expected = float((ref["preds"] == ref["target"]).float().mean())
    for _ in range(2):  # a second run must not accumulate the first one's samples
        metrics = tr.test(Module(), dataloaders=DataLoader(MapData(6), batch_size=4), verbose=False)[0]
        assert metrics["test/acc"] == pytest.approx(expected, abs=1e-7)


def test_metric_collection_is_copied_and_updated_per_batch_like_a_metric():
    """The user's collection is never updated (no state across runs); a copy of it sees every batch."""
    collection = torchmetrics.MetricCollection({"rows": RowCount()})
    callback = GatherForMetrics({"c": collection})
    tr = trainer(callback)
    RowCount.calls.clear()
    for _ in range(2):
        metrics = tr.validate(Module(), dataloaders=DataLoader(MapData(11), batch_size=4), verbose=False)[0]
        assert metrics["val/c/rows"] == 11
    user_object = id(collection["rows"])
    assert collection["rows"].rows.item() == 0
    assert [rows for _, rows in RowCount.calls] == [4, 4, 3] * 2, "one update per batch"
    assert all(owner != user_object for owner, _ in RowCount.calls)


def test_each_trainer_run_starts_fresh():
    """A new run drops the previous run's results for the stages it evaluates and re-creates the metric copies."""
    callback = GatherForMetrics({"acc": torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")})
    trainer(callback).validate(Module(), dataloaders=DataLoader(MapData(6), batch_size=4), verbose=False)
    assert set(callback.results["validate"]) == {"val/acc"}
    trainer(callback).test(Module(), dataloaders=DataLoader(MapData(6), batch_size=4), verbose=False)
    assert set(callback.results) == {"validate", "test"}, "a test run keeps the last validation results"
    # a validation run that evaluates nothing must not report the previous run's values
    trainer(callback, limit_val_batches=0).validate(
        Module(), dataloaders=DataLoader(MapData(6), batch_size=4), verbose=False
    )
    assert set(callback.results) == {"test"}
    with pytest.raises(KeyError, match="has not seen a validate batch from dataloader 0"):
        callback.state_for("validate", 0)


def test_the_sync_dist_hint_filter_does_not_outlive_the_run():
    before = list(warnings.filters)
    callback = GatherForMetrics({"acc": torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")})
    trainer(callback).validate(Module(), dataloaders=DataLoader(MapData(6), batch_size=4), verbose=False)
    assert warnings.filters == before


def test_missing_output_key_is_a_clear_error():
    callback = GatherForMetrics({"acc": torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES)})
    assert issubclass(StepOutputError, GatherError)
    with pytest.raises(
        StepOutputError,
        match=r"GatherForMetrics reads 'preds' and 'target' from what validation_step returns, "
        r"but it returned a dict with keys \['logits', 'y'\] \(missing \['preds', 'target'\]\)",
    ):
        trainer(callback).validate(
            Module("wrong_keys"), dataloaders=DataLoader(MapData(4), batch_size=2), verbose=False
        )
    with pytest.raises(
        StepOutputError,
        match=r"from what test_step returns, but it returned 'NoneType'.*preds_key=\.\.\., target_key=\.\.\.",
    ):
        trainer(callback).test(Module("none"), dataloaders=DataLoader(MapData(4), batch_size=2), verbose=False)
    epoch = GatherForMetrics({"acc": torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES)}, gather_every="epoch")
    with pytest.raises(StepOutputError, match=r"returned a dict with keys \['logits', 'y'\]"):
        trainer(epoch).validate(Module("wrong_keys"), dataloaders=DataLoader(MapData(4), batch_size=2), verbose=False)


def test_outputs_that_are_not_one_row_per_sample_are_a_clear_error():
    callback = GatherForMetrics({"acc": torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES)})
    with pytest.raises(
        StepOutputError,
        match=r"^GatherForMetrics: validation_step returned 'preds' with 4 rows on dim 0, but "
        r"the batch has 2 samples\. Return one row per sample \(dim 0 = the batch",
    ):
        trainer(callback).validate(Module("per_token"), dataloaders=DataLoader(MapData(4), batch_size=2), verbose=False)
    with pytest.raises(StepOutputError, match=r"returned 'target' with a 0-d tensor, but the batch has 2 samples"):
        trainer(callback).validate(Module("scalar"), dataloaders=DataLoader(MapData(4), batch_size=2), verbose=False)


def test_no_metrics_only_tracks_for_hand_written_gathers():
    callback = GatherForMetrics()
    module = Module("none")
    trainer(callback).validate(module, dataloaders=DataLoader(MapData(5), batch_size=2), verbose=False)
    assert [idx.tolist() for idx, _ in module.by_hand] == [[0, 1], [2, 3], [4]]
    assert callback.state_for("validate", 0).batches == 3


def test_constructor_rejects_non_metrics():
    with pytest.raises(TypeError, match=r"expects a dict of metrics .* got MulticlassAccuracy; wrap it"):
        GatherForMetrics(torchmetrics.classification.MulticlassAccuracy(3))
    with pytest.raises(
        TypeError, match=r"metric 'acc' is a int; pass a torchmetrics Metric or MetricCollection, or a callable"
    ):
        GatherForMetrics({"acc": 3})
    with pytest.raises(
        ValueError,
        match=r"GatherForMetrics\(gather_every='step'\): use 'auto', 'batch', 'epoch' or a number of batches >= 1",
    ):
        GatherForMetrics(gather_every="step")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("wrapper", [DistributedSamplerWrapper, UnrepeatedDistributedSamplerWrapper])
def test_lightning_sampler_wrappers_keep_each_index_once(world, wrapper):
    """Lightning wraps custom samplers; the accounting reads their layout like a DistributedSampler's."""
    subset = [5, 3, 8, 1, 9, 0, 7]  # a custom sampler over 7 of 10 samples
    kept = []
    for rank in range(world):
        sampler = wrapper(
            SubsetRandomSampler(subset, generator=torch.Generator().manual_seed(0)),
            num_replicas=world,
            rank=rank,
            shuffle=False,
        )
        indices = list(sampler)
        state = GatherState.from_dataloader(DataLoader(MapData(10), sampler=sampler), rank=rank, world_size=world)
        kept += indices[: state.real_samples]
    assert sorted(kept) == sorted(subset)


@pytest.mark.gpu
def test_single_cuda_device_metrics_equal_reference():
    """Metric copies follow the module to the GPU; outputs stay on it."""
    n = 9
    ref = reference(n)
    callback = GatherForMetrics({"acc": torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")})
    tr = quiet_trainer(
        accelerator="gpu",
        devices=1,
        callbacks=[callback],
    )
    metrics = tr.validate(Module(), dataloaders=DataLoader(MapData(n), batch_size=4), verbose=False)[0]
    assert metrics["val/acc"] == pytest.approx(float((ref["preds"] == ref["target"]).float().mean()), abs=1e-7)
    assert callback.results["validate"]["val/acc"].device.type == "cuda"


@pytest.mark.gpu
def test_metric_copies_follow_the_module_to_another_device_between_runs():
    """Validate on CPU, then on a GPU with the same callback: the copies are re-created on the new device."""
    callback = GatherForMetrics(
        {
            "acc": torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro"),
            "c": torchmetrics.MetricCollection({"rows": RowCount()}),
        }
    )
    loader = DataLoader(MapData(9), batch_size=4)
    cpu = trainer(callback).validate(Module(), dataloaders=loader, verbose=False)[0]
    gpu = trainer(callback, accelerator="gpu").validate(Module(), dataloaders=loader, verbose=False)[0]
    assert gpu["val/acc"] == pytest.approx(cpu["val/acc"], abs=1e-7) and gpu["val/c/rows"] == 9
    assert callback.results["validate"]["val/c/rows"].device.type == "cuda"
