"""Worker: LoRA on a pretrained Llama built under ``fabric.init_module()`` with Fabric's ZeRO-3 (2 ranks).

usage: zero_lora.py OUT STRATEGY   (OUT/pretrained: the pretrained files, written by the test; STRATEGY: zero3,
zero3_offload or zero3_nvme)

2 steps, ``fabric.save(OUT/ck_first)``; a new model and optimizer ``fabric.load`` it and train to step 4, then
``fabric.save(OUT/ck_last)``. Each rank writes OUT/result_<rank>.pt: the PEFT model's gathered state.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

import lightspeed  # noqa: F401  # registers the strategy names
from _support import lora
from _support.models import rank_batches


def build(fabric: L.Fabric, pretrained: Path) -> tuple[Any, Any]:
    with fabric.init_module():
        model = lora.lora_model(pretrained)
    return fabric.setup(model, lora.optimizer(model))


def train(fabric: L.Fabric, model: Any, optimizer: Any, steps: range) -> None:
    data = lora.tokens()
    batches = rank_batches(lora.SAMPLES, lora.WORLD, lora.BATCH, epoch=0)
    for step in steps:
        loss = lora.lm_loss(model, data[batches[step][fabric.global_rank]])
        fabric.backward(loss, model=model)  # the second set-up makes Fabric ask which model
        optimizer.step()
        optimizer.zero_grad()


def main(out: Path, strategy: str) -> None:
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=lora.WORLD)
    fabric.launch()
    model, optimizer = build(fabric, out / "pretrained")
    train(fabric, model, optimizer, range(2))
    fabric.save(out / "ck_first", {"model": model, "optimizer": optimizer})
    model, optimizer = build(fabric, out / "pretrained")
    fabric.load(out / "ck_first", {"model": model, "optimizer": optimizer})
    train(fabric, model, optimizer, range(2, lora.STEPS))
    fabric.save(out / "ck_last", {"model": model, "optimizer": optimizer})
    import deepspeed

    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        state = {key: value.detach().clone() for key, value in model.module.state_dict().items()}
    torch.save({strategy: state}, out / f"result_{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
