"""Worker for tests/callbacks/test_gather_for_metrics_distributed.py: GatherForMetrics under a real Lightning run.

``python gather_lightning.py OUT_DIR WORLD STRATEGY``: one Trainer (CPU, ``devices=WORLD``, Lightning's own
launcher) runs ``fit`` (sanity check, 2 training steps with Adam at lr=0, validation), ``validate`` and ``test`` over
several dataloaders. Every rank saves ``rank{r}.pt``: what the callback logged, what ``gather_for_metrics`` returned
by hand (per batch in ``validation_step`` and once in ``on_validation_epoch_end``), the values torchmetrics'
plain ``sync_dist`` logging produced on the same run, Lightning's ``sync_dist=True`` hints raised during the runs,
and, per ``gather_every`` mode, the error each rank got from a validation in which rank 1's step returns the wrong
keys. Four GatherForMetrics callbacks run side by side, one per ``gather_every`` mode (``"auto"``, ``"batch"``,
2 batches, ``"epoch"``); each also logs :class:`UpdateSizes`, which shows how the metric updates were split.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torchmetrics
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "core" / "gather" / "scripts"))
import lightning as L  # noqa: E402
from gather_data import NUM_CLASSES, LengthIterable, MapData, ShardedIterable, model  # noqa: E402
from gather_scenarios import SHUFFLE_SEED, BatchableData, WholeStreamWithLen  # noqa: E402

import lightspeed  # noqa: E402
from _support.trainers import quiet_trainer  # noqa: E402
from lightspeed.callbacks import GatherForMetrics  # noqa: E402

# validation dataloaders, in order: name -> (kind, n, batch_size, shuffle)
VAL = {
    "map_ragged": ("map", 11, 2, False),
    "map_shuffle": ("map", 17, 3, True),
    "map_divides": ("map", 12, 2, False),
    "iterable_len": ("iterable_len", 11, 2, False),
    "iterable_nolen": ("iterable_nolen", 10, 2, False),
}
TEST = ("map", 13, 4, False)
#: logged-name prefix -> gather_every of the callback that logs under it
MODES = {"val": "auto", "val_batch": "batch", "val_w2": 2, "val_epoch": "epoch"}


class UpdateSizes(torchmetrics.Metric):
    """Sum over update calls of (rows in the call)^2: equals the per-batch value only if each batch was one update."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("squares", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.squares += float(len(preds)) ** 2

    def compute(self) -> torch.Tensor:
        return self.squares


class RankShard(IterableDataset):
    """Looks up its rank when iterated (the process group exists by then) and yields that rank's shard."""

    def __init__(self, n: int, with_len: bool) -> None:
        self.n, self.with_len = n, with_len

    def __iter__(self):
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        shard = (
            LengthIterable(self.n, rank, world) if self.with_len else ShardedIterable(self.n, rank, world, padded=False)
        )
        return iter(shard)


class RankShardWithLen(RankShard):
    def __len__(self) -> int:  # the total over all ranks
        return self.n


def loader(kind: str, n: int, batch_size: int, shuffle: bool) -> DataLoader:
    if kind == "map":
        return DataLoader(MapData(n), batch_size=batch_size, shuffle=shuffle)
    if kind == "iterable_len":
        return DataLoader(RankShardWithLen(n, True), batch_size=batch_size)
    return DataLoader(RankShard(n, False), batch_size=batch_size)


class EvalModule(L.LightningModule):
    def __init__(self, callback: GatherForMetrics) -> None:
        super().__init__()
        self.net = model()
        self.callback = callback
        self.plain_acc = torch.nn.ModuleList(
            torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro") for _ in range(len(VAL) + 1)
        )
        self.plain_count = torch.nn.ModuleList(torchmetrics.SumMetric() for _ in range(len(VAL) + 1))
        self.record: dict = defaultdict(dict)
        self._per_batch: dict = defaultdict(list)
        self._local: dict = defaultdict(list)
        self.phase = "fit"

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.0)  # lr 0: predictions stay the reference ones

    def _eval_step(self, batch, dataloader_idx: int, plain_idx: int):
        x, y, idx = batch
        preds = self.net(x).argmax(-1)
        # by hand: the callback made this dataloader's state current
        gathered = lightspeed.gather_for_metrics({"idx": idx, "names": [f"s{int(i)}" for i in idx]})
        self._per_batch[dataloader_idx].append(gathered)
        self._local[dataloader_idx].append(idx)
        # torchmetrics' own sync: counts the sampler's duplicates
        self.plain_acc[plain_idx].update(preds, y)
        self.plain_count[plain_idx].update(torch.ones(len(idx), dtype=torch.float64))
        return {"logits_argmax": preds, "labels": y}

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        out = self._eval_step(batch, dataloader_idx, dataloader_idx)
        # logged without sync_dist under a prefix the callback also uses: Lightning's hint must still reach the user
        self.log("val/own", out["labels"].float().mean(), on_epoch=True)
        self.log("plain/acc", self.plain_acc[dataloader_idx], sync_dist=True, on_epoch=True)
        self.log("plain/count", self.plain_count[dataloader_idx], sync_dist=True, on_epoch=True)
        return out

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        out = self._eval_step(batch, 0, len(VAL))
        self.log("plain/acc", self.plain_acc[len(VAL)], sync_dist=True, on_epoch=True)
        self.log("plain/count", self.plain_count[len(VAL)], sync_dist=True, on_epoch=True)
        return out

    def _epoch_end(self, stage: str) -> None:
        if self.trainer.sanity_checking:
            self._per_batch.clear()
            self._local.clear()
            return
        key = f"{self.phase}"
        for idx in sorted(self._local):
            state = self.callback.state_for(stage, idx)
            once = lightspeed.gather_for_metrics(torch.cat(self._local[idx]), state=state)
            per_batch = self._per_batch[idx]
            self.record[key][idx] = {
                "per_batch_idx": torch.cat([g["idx"] for g in per_batch]),
                "per_batch_names": [n for g in per_batch for n in g["names"]],
                "epoch_end_idx": once,
            }
        self._per_batch.clear()
        self._local.clear()

    def on_validation_epoch_end(self) -> None:
        self._epoch_end("validate")

    def on_test_epoch_end(self) -> None:
        self._epoch_end("test")


class Rank1Differs(L.LightningModule):
    """``validation_step`` returns ``outputs(preds, target, rank)``, so that rank 1 can return what the others don't."""

    def __init__(self, outputs) -> None:
        super().__init__()
        self.net = model()
        self.outputs = outputs

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        return self.outputs(self.net(x).argmax(-1), y, self.global_rank)


def validation_error(world: int, callback: GatherForMetrics, module: L.LightningModule, n: int | None) -> str | None:
    """The error this rank got from validating ``module`` over ``n`` samples (every rank must get one, none hang)."""
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp",
        callbacks=[callback],
    )
    try:
        loaders = DataLoader(MapData(n), batch_size=2) if n is not None else None  # None: the module's own
        trainer.validate(module, dataloaders=loaders, verbose=False)
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return None


def wrong_keys_errors(world: int) -> dict[str, str | None]:
    """Per gather_every mode: the error when rank 1's step returns the wrong keys."""
    module = Rank1Differs(
        lambda p, y, rank: {"logits": p, "labels": y} if rank == 1 else {"logits_argmax": p, "labels": y}
    )
    metrics = {"acc": torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")}
    return {
        mode: validation_error(
            world,
            GatherForMetrics(metrics, preds_key="logits_argmax", target_key="labels", gather_every=mode),
            module,
            7,
        )
        for mode in dict.fromkeys(MODES.values())
    }


def ragged_errors(world: int) -> str | None:
    """The error when rank 1's predictions have 4 columns and the others' 1: the ranks size their windows apart."""
    module = Rank1Differs(lambda p, y, rank: {"preds": p[:, None].repeat(1, 4 if rank == 1 else 1), "target": y})
    callback = GatherForMetrics(
        {"n": lambda preds, target: torch.tensor(float(len(preds)))}, buffer_limit=64
    )  # 2 batches of 1 column
    return validation_error(world, callback, module, 4 * world)


class OwnLoader(Rank1Differs):
    """Validates over the dataloader ``make()`` builds once the process group exists (so it can hold a sampler)."""

    def __init__(self, make) -> None:
        super().__init__(lambda p, y, rank: {"preds": p, "target": y})
        self.make = make

    def validation_step(self, batch, batch_idx):
        x, y, idx = batch
        return {"preds": self.net(x).argmax(-1), "target": y, "idx": idx}

    def val_dataloader(self):
        return self.make()


def order_checksum(idx: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    """sum over positions p of (p + 1) * idx[p]: equal for two orders of 0..n-1 only if they are the same here."""
    return (idx.double() * torch.arange(1, len(idx) + 1, dtype=torch.float64)).sum()


def nested_sampler_loader() -> DataLoader:
    """22 samples, a shuffled DistributedSampler inside a BatchSampler given as ``sampler=`` (batch_size=None)."""
    data = BatchableData(22)
    sampler = BatchSampler(DistributedSampler(data, shuffle=True, seed=SHUFFLE_SEED), batch_size=4, drop_last=False)
    return DataLoader(data, batch_size=None, sampler=sampler)


def issue12_runs(world: int) -> dict[str, Any]:
    """Issue #12 through the callback: the metric over a nested batch sampler, and an unsharded stream's error."""
    metrics = {
        "acc": torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro"),
        "count": lambda preds, target: torch.tensor(float(len(preds)), dtype=torch.float64),
    }
    callback = GatherForMetrics(metrics)
    order = GatherForMetrics({"checksum": order_checksum}, preds_key="idx", target_key="idx", val_prefix="order/")
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp",
        callbacks=[callback, order],
        use_distributed_sampler=False,  # the loader brings its own DistributedSampler
    )
    trainer.validate(OwnLoader(nested_sampler_loader), verbose=False)
    unsharded = validation_error(
        world,
        GatherForMetrics({"acc": torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")}),
        OwnLoader(lambda: DataLoader(WholeStreamWithLen(30), batch_size=4)),
        None,
    )
    return {"nested_sampler": {**callback.results["validate"], **order.results["validate"]}, "unsharded": unsharded}


def main() -> None:
    out_dir, world, strategy = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    callback = GatherForMetrics(
        {
            "acc": torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro"),
            "f1": torchmetrics.classification.MulticlassF1Score(NUM_CLASSES, average="macro"),
            "count": lambda preds, target: torch.tensor(float(len(preds)), dtype=torch.float64),
            "sizes": UpdateSizes(),
        },
        preds_key="logits_argmax",
        target_key="labels",
    )
    # the same metrics gathered in the other windows
    others = [
        GatherForMetrics(
            {
                "acc": torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro"),
                "sizes": UpdateSizes(),
            },
            preds_key="logits_argmax",
            target_key="labels",
            val_prefix=f"{prefix}/",
            test_prefix=f"{prefix.replace('val', 'test')}/",
            gather_every=mode,
        )
        for prefix, mode in MODES.items()
        if prefix != "val"
    ]
    module = EvalModule(callback)
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        callbacks=[callback, *others],
        max_epochs=1,
        limit_train_batches=2,
        num_sanity_val_steps=1,
    )
    val_loaders = [loader(*spec) for spec in VAL.values()]
    logged = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train_dataloaders=DataLoader(MapData(8), batch_size=2), val_dataloaders=val_loaders)
        logged["fit"] = {k: v.clone() for k, v in trainer.callback_metrics.items()}
        module.phase = "validate"
        trainer.validate(module, dataloaders=val_loaders, verbose=False)
        logged["validate"] = {k: v.clone() for k, v in trainer.callback_metrics.items()}
        module.phase = "test"
        trainer.test(module, dataloaders=loader(*TEST), verbose=False)
        logged["test"] = {k: v.clone() for k, v in trainer.callback_metrics.items()}
    hints = [str(w.message) for w in caught if "sync_dist=True" in str(w.message)]
    torch.save(
        {
            "logged": logged,
            "record": dict(module.record),
            "results": callback.results,
            "world": trainer.world_size,
            "sync_dist_hints": hints,
            "wrong_keys": wrong_keys_errors(world),
            "ragged": ragged_errors(world),
            "issue12": issue12_runs(world),
        },
        out_dir / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    os.environ.setdefault("LIGHTSPEED_GATHER_TIMEOUT", "120")
    main()
