"""Worker: a tiny top-2 mixture-of-experts LightningModule (built in ``configure_model``) under
``ZeroStrategy(stage=1)``, then ``stage=3`` (partitioned at creation), 2 CPU ranks, fp32, each rank's tokens routed to
other experts at every step, two experts reached by no token in one step (:mod:`_support.moe`). Under ZeRO-3 the MoE
block is found and marked as a leaf module before the engine is built.

Rank 0 writes OUT/result.pt: the trained weights (ZeRO-3's, gathered), whether the block was marked, ZeRO-1's.

usage: zero_moe.py OUT [LEAF_MODULES]   (LEAF_MODULES "none": ``leaf_modules=None``, to see the failure by hand)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightspeed
from _support import moe
from _support.models import full_state_dict
from _support.trainers import quiet_trainer


class MoeModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net: moe.MoeNet | None = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = moe.make_moe_net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert self.net is not None
        return moe.loss(self.net, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.net is not None
        return moe.optimizer(self.net)


def train(strategy: lightspeed.strategies.ZeroStrategy) -> tuple[int, moe.MoeNet]:
    trainer = quiet_trainer(
        strategy=strategy, accelerator="cpu", devices=moe.WORLD, max_steps=moe.STEPS, use_distributed_sampler=False
    )
    module = MoeModule()
    loader = DataLoader(moe.rank_batches(trainer.global_rank), batch_size=None)  # each rank its own micro-batches
    trainer.fit(module, loader)
    assert module.net is not None
    return trainer.global_rank, module.net


def main(out: Path, leaf_modules: Any) -> None:
    _, zero1 = train(lightspeed.strategies.ZeroStrategy(stage=1))
    rank, net = train(
        lightspeed.strategies.ZeroStrategy(stage=3, param_persistence_threshold=0, leaf_modules=leaf_modules)
    )
    weights = full_state_dict(net)
    if rank == 0:
        result = {"weights": weights, "leaf": bool(getattr(net.moe, "_z3_leaf", False)), "zero1": zero1.state_dict()}
        torch.save(result, out / "result.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), None if sys.argv[2:] == ["none"] else "auto")
