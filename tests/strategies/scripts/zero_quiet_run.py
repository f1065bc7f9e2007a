"""Worker: a reduced version of the README's main job (examples/train_lm.py): zero3_offload on 2 CPU ranks started
by Lightning's own launcher, gradient accumulation and clipping, a validation loop with synced metrics, then test
and predict. The test counts the warning lines this prints."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightspeed  # noqa: F401


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(32, 24), nn.Flatten(), nn.Linear(24 * 8, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val/loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val/accuracy", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 32, (n, 8), generator=gen)
    return TensorDataset(x, x[:, 0])


if __name__ == "__main__":
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        strategy="zero3_offload",
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
    )
    model = Tiny()
    trainer.fit(model, DataLoader(data(96, 1), batch_size=8, shuffle=True), DataLoader(data(40, 2), batch_size=8))
    trainer.test(model, DataLoader(data(40, 2), batch_size=8))
    trainer.predict(model, DataLoader(data(40, 2), batch_size=8))
    if trainer.is_global_zero:
        print(f"done: {trainer.global_step} steps", flush=True)
