"""Worker: model shapes under the Trainer's ZeRO-3 on 2 CPU ranks, fp32: an ``nn.TransformerEncoder`` built in
``configure_model`` (it deep-copies its layer inside ZeRO-3's init context), trained ``STEPS`` steps; an MLP
initialised again by its parent in ``configure_model``, gathered when training starts; a layer some micro-batches skip,
with accumulation over 2 and AdamW, under every ZeRO stage with and without optimizer offload, and under ZeRO-2
resumed from a checkpoint taken right after a window that skipped it.

Rank 0 writes OUT/result.pt: the gathered weights per case.

usage: zero_model_shapes.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401  (registers the strategy names)
from _support import model_shapes as ms
from _support.models import full_state_dict, make_regression_data
from _support.trainers import quiet_trainer


class EncoderInConfigureModel(L.LightningModule):
    def configure_model(self) -> None:
        self.model = ms.EncoderRegressor()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return ms.encoder_loss(self.model, *batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return ms.encoder_optimizer(self.model)


def encoder_in_configure_model() -> dict[str, torch.Tensor]:
    module = EncoderInConfigureModel()
    trainer = quiet_trainer(strategy="zero3", accelerator="cpu", devices=2, max_steps=ms.STEPS)
    trainer.fit(module, DataLoader(ms.encoder_data(), batch_size=ms.BATCH, shuffle=True))
    return full_state_dict(module.model)


class ReinitializedInConfigureModel(EncoderInConfigureModel):
    def configure_model(self) -> None:
        self.model = ms.ReinitializedMLP()

    def on_train_start(self) -> None:
        self.initial = full_state_dict(self.model)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0]).square().mean()


def reinitialized_in_configure_model() -> dict[str, torch.Tensor]:
    module = ReinitializedInConfigureModel()
    trainer = quiet_trainer(strategy="zero3", accelerator="cpu", devices=2, max_steps=1)
    trainer.fit(module, DataLoader(make_regression_data(8), batch_size=4))
    return module.initial


class SometimesSkippedModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = ms.SometimesSkipped()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x, ms.uses_skippable(batch_idx)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return ms.skip_optimizer(self.model.parameters())


def sometimes_skipped(name: str) -> dict[str, torch.Tensor]:
    module = SometimesSkippedModule()
    trainer = quiet_trainer(strategy=name, accelerator="cpu", devices=2, max_epochs=1, accumulate_grad_batches=2)
    trainer.fit(module, DataLoader(ms.skip_data(), batch_size=ms.SKIP_BATCH))
    return full_state_dict(module.model)


def sometimes_skipped_resumed(out: Path) -> dict[str, torch.Tensor]:
    """zero2: checkpointed right after the window that skipped the layer (a run that goes one step further), then a
    new Trainer resumes from that checkpoint and finishes the epoch."""
    loader = DataLoader(ms.skip_data(), batch_size=ms.SKIP_BATCH)
    saver = ModelCheckpoint(dirpath=out, filename="skipped", every_n_train_steps=ms.SAVED_WINDOWS, save_top_k=-1)
    common = {"strategy": "zero2", "accelerator": "cpu", "devices": 2, "accumulate_grad_batches": 2}
    quiet_trainer(**common, max_steps=ms.SAVED_WINDOWS + 1, callbacks=[saver], enable_checkpointing=True).fit(
        SometimesSkippedModule(), loader
    )
    module = SometimesSkippedModule()
    quiet_trainer(**common, max_epochs=1).fit(module, loader, ckpt_path=out / "skipped.ckpt")
    return full_state_dict(module.model)


def main() -> None:
    out = Path(sys.argv[1])
    result = {
        "encoder_in_configure_model": encoder_in_configure_model(),
        "reinitialized": reinitialized_in_configure_model(),
        **{f"skipped_{name}": sometimes_skipped(name) for name in ms.SKIP_STRATEGIES},
        "resumed_zero2": sometimes_skipped_resumed(out),
    }
    if torch.distributed.get_rank() == 0:
        torch.save(result, out / "result.pt")


if __name__ == "__main__":
    main()
