"""A real single-file Lightning checkpoint for the export tests: ``L.Trainer(accelerator="cpu", devices=1).fit`` of a
LightningModule holding :class:`TinyLM` (tied embedding/head, a frozen layer, float and integer buffers) under
``self.model``, plus a sub-module with non-tensor extra state, then ``trainer.save_checkpoint``."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from checkpoint_models import VOCAB, TinyLM, batch
from torch import nn

from _support.trainers import quiet_trainer


class StepNote(nn.Module):
    """Keeps a plain-Python note in the state dict (``note._extra_state``), as some modules do."""

    def __init__(self) -> None:
        super().__init__()
        self.text = "fresh"

    def get_extra_state(self) -> dict:
        return {"text": self.text}

    def set_extra_state(self, state: dict) -> None:
        self.text = state["text"]


class TinyLightningLM(L.LightningModule):
    """TinyLM under ``self.model`` (so keys start with ``model.``), trained with Adam on generated tokens."""

    def __init__(self, lr: float = 3e-2, label: str = "tiny") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyLM()
        self.note = StepNote()

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(tokens[0])
        self.model.seen_batches += 1
        self.note.text = f"step {batch_idx}"
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[0].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.model.param_groups(), lr=self.hparams.lr)


def train_and_save(root: Path, steps: int = 4) -> tuple[Path, dict[str, torch.Tensor]]:
    """Fit for ``steps`` steps on one CPU device, save ``root/model.ckpt``; returns it and the module's state_dict."""
    torch.manual_seed(0)
    module = TinyLightningLM()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.stack([batch(s) for s in range(steps)])))
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        default_root_dir=str(root),
    )
    trainer.fit(module, data)
    path = root / "model.ckpt"
    trainer.save_checkpoint(path)
    reference = {k: v.detach().clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
    return path, reference
