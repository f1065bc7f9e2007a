"""Worker: a user's LightningCLI script (model, data module, `LightningCLI(Model, Data)`), run with lightspeed's
strategies chosen on the command line. Rank 0 writes $LIGHTSPEED_TEST_OUT (JSON): the strategy's class, its resolved
ZeRO stage and offload target, the world size, the steps trained and the trained weights' sum.

usage: cli_job.py fit --trainer.strategy=... [--trainer.strategy.stage=3] --trainer.devices=2 ...
"""

from __future__ import annotations

import json
import os

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset

import lightspeed  # noqa: F401  (registers the strategy names)
from _support.models import full_state_dict


class Model(L.LightningModule):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def on_train_end(self) -> None:
        strategy = self.trainer.strategy
        zero = strategy.config["zero_optimization"]
        weights = full_state_dict(strategy.deepspeed_engine.module)
        if self.trainer.is_global_zero:
            record = {
                "strategy": type(strategy).__name__,
                "stage": zero["stage"],
                "offload_optimizer": (zero.get("offload_optimizer") or {}).get("device", "none"),
                "world_size": self.trainer.world_size,
                "global_step": self.trainer.global_step,
                "weight_sum": float(sum(value.sum() for value in weights.values())),
            }
            with open(os.environ["LIGHTSPEED_TEST_OUT"], "w") as handle:
                json.dump(record, handle)


class Data(L.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x, y = torch.randn(32, 4, generator=generator), torch.randn(32, 1, generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=4)


if __name__ == "__main__":
    LightningCLI(Model, Data, seed_everything_default=0)
