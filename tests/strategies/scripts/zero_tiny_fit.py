"""Worker: the smallest real 2-rank ZeRO fit (2 steps), for the clean-exit test; prints one line per rank."""

from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401
from _support.models import RegressionModule, make_regression_data

if __name__ == "__main__":
    trainer = L.Trainer(
        strategy="zero2",
        accelerator="cpu",
        devices=2,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(RegressionModule(), DataLoader(make_regression_data(16), batch_size=4))
    print(f"rank {trainer.global_rank} finished step {trainer.global_step}", flush=True)
