"""What ``zero_auto``'s tuner needs from a LightningModule: a copy of it with its optimizer, and one micro-batch's
training loss (:mod:`lightspeed.core.zero.tuner`)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import _configure_optimizers

__all__ = ["copy_lightning_module", "training_loss"]


def copy_lightning_module(module: pl.LightningModule) -> tuple[pl.LightningModule, Any]:
    """A deep copy of ``module`` without its Trainer, and the first optimizer its ``configure_optimizers`` builds for
    the copy (None when it returns none: the DeepSpeed config's optimizer is used)."""
    trainer = module._trainer
    module._trainer = None  # a deep copy would copy the whole Trainer
    try:
        twin = copy.deepcopy(module)
    finally:
        module._trainer = trainer
    configured: Any = twin.configure_optimizers()
    optimizers, _, _ = _configure_optimizers(configured) if configured is not None else ([], [], None)
    return twin, optimizers[0] if optimizers else None


def training_loss(model: torch.nn.Module, batch: Any, index: int) -> torch.Tensor:
    """The loss ``training_step`` returns for ``batch`` (``self.log`` is a no-op without a Trainer: silenced)."""
    assert isinstance(model, pl.LightningModule)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*self.log.*")
        output = model.training_step(batch, index)
    loss = output["loss"] if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"training_step returned {type(output).__name__}; the tuner needs the loss tensor.")
    return loss
