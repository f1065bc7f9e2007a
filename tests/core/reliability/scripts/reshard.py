"""Worker for resuming on another number of processes (run under torchrun with WS ranks).

usage: reshard.py OUT GLOBAL_BATCH ACTION ...  (ACTION: ``write:NAME`` or ``resume:NAME``)

write:NAME:  for each config (ZeRO 1, 2, 3, each with and without CPU optimizer offload; ZeRO 2 and 3 with a block
             registered twice in one nn.Sequential, whose weights DeepSpeed records once): train 3 steps, save
             OUT/NAME/CONFIG/ckpt, then continue from it on the same processes to step 7 (the reference); rank 0
             saves OUT/NAME/CONFIG/reference.pt.
resume:NAME: continue each checkpoint OUT/NAME/CONFIG/ckpt on this run's processes to step 7 with the same global
             batch; rank 0 saves OUT/NAME/CONFIG/resumed.pt.
Data: 48 samples, global batch 12 (4 steps per epoch, so the checkpoint at step 3 is mid-epoch and the continued run
crosses an epoch); 4, 3 and 2 ranks split every global batch evenly.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from _support.models import HIDDEN, IN_FEATURES, OUT_FEATURES, RegressionModule, full_state_dict, make_regression_data
from _support.trainers import quiet_trainer
from lightspeed.strategies import ZeroStrategy

FIRST_STEPS, LAST_STEP = 3, 7
CONFIGS = ["s1", "s2", "s3", "s1_offload", "s2_offload", "s3_offload", "s2_shared", "s3_shared"]


class SharedBlockRegression(RegressionModule):
    """``net.2`` and ``net.4`` are one block (registered twice in one parent)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        block = nn.Linear(HIDDEN, HIDDEN)
        self.net = nn.Sequential(
            nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), block, nn.Tanh(), block, nn.Linear(HIDDEN, OUT_FEATURES)
        )


def module(config: str) -> RegressionModule:
    return SharedBlockRegression() if config.endswith("shared") else RegressionModule()


def trainer(config: str, root: Path, max_steps: int) -> L.Trainer:
    stage = int(config[1])
    strategy = ZeroStrategy(stage=stage, offload_optimizer="cpu" if config.endswith("offload") else "none")
    return quiet_trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        max_steps=max_steps,
        default_root_dir=root,
    )


def loader(global_batch: int, world_size: int) -> DataLoader:
    return DataLoader(make_regression_data(48), batch_size=global_batch // world_size, shuffle=True)


def continue_from(ckpt: Path, config: str, root: Path, global_batch: int) -> dict[str, torch.Tensor]:
    L.seed_everything(0, verbose=False)
    run = trainer(config, root, LAST_STEP)
    run.fit(module(config), loader(global_batch, run.world_size), ckpt_path=ckpt)
    assert run.global_step == LAST_STEP, run.global_step
    return full_state_dict(run.lightning_module)


def main(out: Path, global_batch: int, actions: list[str]) -> None:
    for action in actions:
        mode, name = action.split(":")
        for config in CONFIGS:
            folder = out / name / config
            folder.mkdir(parents=True, exist_ok=True)
            ckpt = folder / "ckpt"
            if mode == "write":
                L.seed_everything(0, verbose=False)
                first = trainer(config, folder, FIRST_STEPS)
                first.fit(module(config), loader(global_batch, first.world_size))
                first.save_checkpoint(ckpt)
                weights, result = continue_from(ckpt, config, folder, global_batch), "reference.pt"
            else:
                weights, result = continue_from(ckpt, config, folder, global_batch), "resumed.pt"
            if torch.distributed.get_rank() == 0:
                torch.save(weights, folder / result)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
