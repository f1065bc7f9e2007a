"""Worker (torchrun, 2 ranks): resume a ZeRO-3 fit from a consolidated single-process Lightning checkpoint with
``ZeroStrategy(stage=3, load_full_weights=True)`` and take one more step; rank 0 saves the weights to OUT/STRATEGY.pt.

usage: zero_full_weights.py CKPT OUT OFFLOAD (OFFLOAD: none or cpu for the parameters)

The loss does not depend on the batch, so the test recomputes the step from the loaded weights in one process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from zero_full_weights_model import ProbeModule

from _support.models import full_state_dict, make_regression_data
from _support.trainers import quiet_trainer
from lightspeed.strategies import ZeroStrategy


def main(ckpt: Path, out: Path, offload: str) -> None:
    strategy = ZeroStrategy(stage=3, offload_parameters=offload, load_full_weights=True)
    trainer = quiet_trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=2,
        num_sanity_val_steps=0,
    )
    trainer.fit(ProbeModule(seed=0), DataLoader(make_regression_data(16), batch_size=2), ckpt_path=ckpt)
    weights = full_state_dict(trainer.lightning_module)
    if trainer.is_global_zero:
        torch.save({"weights": weights, "global_step": trainer.global_step}, out / f"{offload}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
