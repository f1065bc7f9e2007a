"""Worker: the smallest real 2-rank ZeRO fit (2 steps), for the clean-exit test; prints one line per rank."""

from __future__ import annotations

from torch.utils.data import DataLoader

import lightspeed  # noqa: F401
from _support.models import RegressionModule, make_regression_data
from _support.trainers import quiet_trainer

if __name__ == "__main__":
    trainer = quiet_trainer(
        strategy="zero2",
        accelerator="cpu",
        devices=2,
        max_steps=2,
    )
    trainer.fit(RegressionModule(), DataLoader(make_regression_data(16), batch_size=4))
    print(f"rank {trainer.global_rank} finished step {trainer.global_step}", flush=True)
