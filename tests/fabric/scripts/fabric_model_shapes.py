"""Worker: model shapes under Fabric's ZeRO-3 (with and without offload) on 2 CPU ranks, fp32: an
``nn.TransformerEncoder`` built under ``fabric.init_module()`` (it deep-copies its layer while ZeRO-3 partitions what
is built), set up and trained ``STEPS`` steps; an MLP initialised again by its parent, gathered right after
``fabric.init_module()``; a layer some micro-batches skip, accumulated over 2 with ``lightspeed.fabric.accumulate``,
under every ZeRO stage with and without optimizer offload.

Rank 0 writes OUT/result.pt: the gathered weights per strategy name (``reinitialized``: the MLP's, under zero3).

usage: fabric_model_shapes.py OUT NAME[,NAME...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

import lightspeed
from _support import model_shapes as ms
from _support.models import full_state_dict, rank_batches


def encoder_under_init_module(name: str) -> dict[str, torch.Tensor]:
    fabric = L.Fabric(strategy=name, accelerator="cpu", devices=2)
    fabric.launch()
    with fabric.init_module():
        model = ms.EncoderRegressor()
    optimizer = ms.encoder_optimizer(model)
    engine, optimizer = fabric.setup(model, optimizer)
    x, y = ms.encoder_data().tensors
    for ranks in ms.encoder_steps():
        index = torch.tensor(ranks[fabric.global_rank])
        optimizer.zero_grad()
        fabric.backward(ms.encoder_loss(engine, x[index], y[index]))
        optimizer.step()
    return full_state_dict(model)


def reinitialized_under_init_module() -> dict[str, torch.Tensor]:
    fabric = L.Fabric(strategy="zero3", accelerator="cpu", devices=2)
    fabric.launch()
    with fabric.init_module():
        model = ms.ReinitializedMLP()
    return full_state_dict(model)


def sometimes_skipped(name: str) -> dict[str, torch.Tensor]:
    fabric = L.Fabric(strategy=name, accelerator="cpu", devices=2)
    fabric.launch()
    model = ms.SometimesSkipped()
    optimizer = torch.optim.SGD(model.parameters(), lr=ms.SKIP_LR)
    engine, optimizer = fabric.setup(model, optimizer)
    x, y = ms.skip_data().tensors
    mine = [torch.tensor(ranks[fabric.global_rank]) for ranks in rank_batches(len(x), 2, ms.SKIP_BATCH, epoch=0)]
    batches = [(x[index], y[index]) for index in mine]
    for (xb, yb), step in lightspeed.fabric.accumulate(fabric, engine, batches, steps=2):
        step.backward(torch.nn.functional.mse_loss(engine(xb, ms.uses_skippable(step.index)), yb))
        if step.sync_gradients:
            optimizer.step()
            optimizer.zero_grad()
    return full_state_dict(model)


def main() -> None:
    out = Path(sys.argv[1])
    result = {name: encoder_under_init_module(name) for name in sys.argv[2].split(",")}
    result["reinitialized"] = reinitialized_under_init_module()
    result.update({f"skipped_{name}": sometimes_skipped(name) for name in ms.SKIP_STRATEGIES})
    if torch.distributed.get_rank() == 0:
        torch.save(result, out / "result.pt")


if __name__ == "__main__":
    main()
