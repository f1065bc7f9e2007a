"""Worker: the Trainer's ZeRO-3 (2 ranks, fp32) over validation dataloaders whose ranks run different numbers of
batches (``tests/_support/uneven_evaluation.py``: hand-made shards, ``use_distributed_sampler=False``), with
``GatherForMetrics``: ``fit`` (sanity check, two training steps, one validation epoch), then ``validate`` and
``predict`` on the training engine.

usage: zero_uneven_evaluation.py OUT
The validation step predicts through a ``generate`` inside ``lightspeed.gathered_for_generation`` (as a HuggingFace
model would in ``validation_step``). Rank 0 writes OUT/trainer.json: per rank, per validation epoch the metrics logged,
the batches run per dataloader and whether the model was partitioned again by the callbacks' epoch-end hooks; the
predictions; whether the parameters were partitioned after each evaluation; per validation step what
``gathered_for_generation`` yielded and the ``synced_gpus`` that ``generate`` got.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightspeed
from _support.models import make_net
from _support.trainers import quiet_trainer
from _support.uneven_evaluation import MODEL_SEED, SHARDS, TIMEOUT_S, dataset, metrics, shard_loader
from lightspeed.callbacks import GatherForMetrics


class Net(torch.nn.Module):
    """The reference model with a HuggingFace-like ``generate`` (it takes ``synced_gpus``, which lightspeed sets under
    ZeRO-3) that records what it got and runs one forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net(MODEL_SEED)
        self.synced: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def generate(self, x: torch.Tensor, synced_gpus: bool | None = None) -> torch.Tensor:
        self.synced.append(synced_gpus)
        return self(x).argmax(-1)


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Net()
        self.partitioned_after: list[bool] = []
        self.generation: list[list[Any]] = []  # per validation step: gathered_for_generation's answer, synced_gpus
        self.allow_zero_length_dataloader_with_multiple_devices = True  # rank 1 has no batch of dataloader 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, torch.Tensor]:
        x, y = batch
        with lightspeed.gathered_for_generation(self.model) as whole:  # as in examples/finetune_pretrained.py
            preds = self.model.generate(x)
        self.generation.append([whole, self.model.synced[-1]])
        return {"preds": preds, "target": y}

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the weights stay those of the single-process reference

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*dataset().tensors), batch_size=4)  # the same batches on both ranks

    def val_dataloader(self) -> list[DataLoader]:
        return [shard_loader(i, self.global_rank) for i in range(len(SHARDS))]

    def partitioned(self) -> bool:
        """Every parameter is in its partition (none held whole)."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        params = list(self.parameters())
        return all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params if not p.ds_persist) and not any(
            p.ds_active_sub_modules for p in params
        )

    def _check_partitioned(self) -> None:
        self.partitioned_after.append(self.partitioned())

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._check_partitioned()  # after the sanity check's evaluation


class Record(L.Callback):
    """Per validation epoch: the values GatherForMetrics logged and the batches this rank ran of each dataloader."""

    def __init__(self, gather: GatherForMetrics) -> None:
        self.gather = gather
        self.epochs: list[dict[str, Any]] = []
        self._batches: list[int] = []

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._batches = [0] * len(SHARDS)

    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._batches[dataloader_idx] += 1

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # runs after GatherForMetrics's (callbacks run in order), which has logged this epoch's values
        assert isinstance(pl_module, Classifier)
        self.epochs.append(
            {
                "partitioned_at_epoch_end": pl_module.partitioned(),  # checkpoints saved from here on see partitions
                "sanity": trainer.sanity_checking,
                "fn": str(trainer.state.fn.value),
                "batches": self._batches,
                "metrics": {name: float(value) for name, value in self.gather.results["validate"].items()},
            }
        )


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    gather = GatherForMetrics(metrics())
    record = Record(gather)
    trainer = quiet_trainer(
        strategy=lightspeed.strategies.ZeroStrategy(stage=3, timeout=timedelta(seconds=TIMEOUT_S)),
        accelerator="cpu",
        devices=2,
        precision="32-true",
        max_epochs=1,
        limit_train_batches=2,
        num_sanity_val_steps=2,
        use_distributed_sampler=False,
        callbacks=[gather, record],
    )
    module = Classifier()
    trainer.fit(module)
    module._check_partitioned()
    trainer.validate(module, verbose=False)
    module._check_partitioned()
    loaders = [shard_loader(i, trainer.global_rank) for i in range(len(SHARDS))]
    predicted = trainer.predict(module, dataloaders=loaders)
    module._check_partitioned()
    facts = {
        "epochs": record.epochs,
        "predict": [torch.cat(p).tolist() if p else [] for p in predicted],  # type: ignore[arg-type]
        "partitioned_after": module.partitioned_after,
        "generation": module.generation,
    }
    ranks = lightspeed.gather_object(facts)
    if trainer.global_rank == 0:
        (out / "trainer.json").write_text(json.dumps(ranks))


if __name__ == "__main__":
    main()
