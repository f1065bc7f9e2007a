"""Worker: a tiny top-2 mixture-of-experts network in a Fabric loop under ``ZeroFabricStrategy(stage=1)``,
``stage=2`` (refused), then ``stage=3``, 2 CPU ranks, fp32, each rank's tokens routed to other experts at every step,
two experts reached by no token in one step (:mod:`_support.moe`). Under ZeRO-3 ``fabric.setup`` finds the MoE
block and marks it as a leaf module before the engine is built.

Rank 0 writes OUT/result.pt: the trained weights (ZeRO-3's gathered), whether the block was marked, ZeRO-1's
weights, and ZeRO-2's error.

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


def train(strategy: lightspeed.fabric.ZeroFabricStrategy) -> tuple[int, torch.nn.Module]:
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=moe.WORLD)
    fabric.launch()
    net = moe.make_moe_net()
    model, optimizer = fabric.setup(net, moe.optimizer(net))
    for micro_batch in moe.rank_batches(fabric.global_rank):
        optimizer.zero_grad()
        fabric.backward(moe.loss(model, micro_batch))
        optimizer.step()
    return fabric.global_rank, net


def zero2_error() -> str:
    try:
        train(lightspeed.fabric.ZeroFabricStrategy(stage=2))
    except lightspeed.errors.DeepSpeedConfigError as err:
        return str(err)
    return "no error"


def main(out: Path, leaf_modules: Any) -> None:
    _, zero1 = train(lightspeed.fabric.ZeroFabricStrategy(stage=1))
    refused = zero2_error()
    rank, net = train(
        lightspeed.fabric.ZeroFabricStrategy(stage=3, param_persistence_threshold=0, leaf_modules=leaf_modules)
    )
    weights = full_state_dict(net)
    if rank == 0:
        result = {"weights": weights, "leaf": bool(getattr(net.moe, "_z3_leaf", False)), "zero1": zero1.state_dict()}
        result["zero2_error"] = refused
        torch.save(result, out / "result.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), None if sys.argv[2:] == ["none"] else "auto")
