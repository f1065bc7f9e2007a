"""Worker: a tiny top-2 mixture-of-experts network in a Fabric loop under ``ZeroFabricStrategy(stage=3)``, 2 CPU
ranks, fp32, each rank's tokens routed to other experts at every step (:mod:`_support.moe`). ``fabric.setup`` finds
the MoE block and marks it as a ZeRO-3 leaf module before the engine is built.

Rank 0 writes OUT/result.pt: the trained weights (gathered) and whether the block was marked.

usage: fabric_moe.py OUT [LEAF_MODULES]   (LEAF_MODULES "none": ``leaf_modules=None``, to see the failure by hand)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

import lightspeed
from _support import moe
from _support.models import full_state_dict


def main(out: Path, leaf_modules: Any) -> None:
    strategy = lightspeed.fabric.ZeroFabricStrategy(stage=3, param_persistence_threshold=0, leaf_modules=leaf_modules)
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=moe.WORLD)
    fabric.launch()
    net = moe.make_moe_net()
    model, optimizer = fabric.setup(net, moe.optimizer(net))
    for micro_batch in moe.rank_batches(fabric.global_rank):
        optimizer.zero_grad()
        fabric.backward(moe.loss(model, micro_batch))
        optimizer.step()
    weights = full_state_dict(net)
    if fabric.global_rank == 0:
        torch.save({"weights": weights, "leaf": bool(getattr(net.moe, "_z3_leaf", False))}, out / "result.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), None if sys.argv[2:] == ["none"] else "auto")
