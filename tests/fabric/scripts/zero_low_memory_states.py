"""Worker: the same short bf16 training under ZeRO with fp32 master weights (DeepSpeed's default), bf16 master weights
and gradients, and bf16 optimizer states too (the strategies' ``bf16_master_weights_and_grads`` /
``bf16_optimizer_states``); records per variant the dtypes and bytes of what the optimizer holds on this rank (its
master partitions and its states), the losses, and the final weights. With the optimizer offloaded, the "bf16_master"
variant also runs saving after half its steps and resuming into a new model and optimizer ("bf16_master_resumed").

usage: zero_low_memory_states.py OUT STAGE OFFLOAD STEPS [WIDTH]    (OFFLOAD: none | cpu; rank 0 writes OUT, a torch
file with one entry per variant). Without offload DeepSpeed keeps bf16 master weights only with bf16 moments, so the
"bf16_master" variant runs with the optimizer offloaded only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

import lightspeed  # noqa: F401  # registers the strategy names
from lightspeed.fabric import ZeroFabricStrategy

VARIANTS = {
    "fp32_master": {},
    "bf16_master": {"bf16_master_weights_and_grads": True},
    "bf16_master_and_states": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
}


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1))


def batches(steps: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=generator)
        out.append((x, x.sum(dim=1, keepdim=True).sin()))
    return out


def held_by_optimizer(engine: Any) -> dict[str, Any]:
    """Dtypes and bytes of the master partitions (the inner optimizer's parameters) and of its states."""
    inner = engine.optimizer.optimizer
    masters = [p for group in inner.param_groups for p in group["params"]]
    states = [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t) and t.numel() > 1]
    return {
        "master_dtypes": sorted({str(p.dtype) for p in masters}),
        "state_dtypes": sorted({str(t.dtype) for t in states}),
        "master_bytes": sum(p.numel() * p.element_size() for p in masters),
        "state_bytes": sum(t.numel() * t.element_size() for t in states),
    }


def run(
    stage: int, offload: str, steps: int, width: int, flags: dict[str, bool], resume_from: Path | None = None
) -> dict[str, Any]:
    """``steps`` steps; with ``resume_from``, half of them, ``fabric.save`` there, then a new model and optimizer
    ``fabric.load`` it and take the rest."""
    fabric = L.Fabric(
        strategy=ZeroFabricStrategy(stage=stage, offload_optimizer=offload, **flags),
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        precision="bf16-mixed",
    )
    fabric.launch()

    def build() -> tuple[Any, Any]:
        model = make_model(width)
        return fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    model, optimizer = build()
    losses = []
    for step, (x, y) in enumerate(batches(steps, fabric.global_rank)):
        if resume_from is not None and step == steps // 2:
            fabric.save(resume_from, {"model": model, "optimizer": optimizer})
            model, optimizer = build()
            fabric.load(resume_from, {"model": model, "optimizer": optimizer})
        loss = nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss, model=model)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach().float(), reduce_op="mean")))
    from deepspeed.utils import safe_get_full_fp32_param

    weights = {name: safe_get_full_fp32_param(p).float().clone() for name, p in model.module.named_parameters()}
    return {**held_by_optimizer(model._forward_module), "losses": losses, "weights": weights}


def main(out: Path, stage: int, offload: str, steps: int, width: int) -> None:
    results = {
        name: run(stage, offload, steps, width, flags)
        for name, flags in VARIANTS.items()
        if offload != "none" or name != "bf16_master"
    }
    if offload != "none":  # fp32 moments beside bf16 master weights: resumed as they were saved
        resumed = run(stage, offload, steps, width, VARIANTS["bf16_master"], resume_from=out.with_name("ck"))
        results["bf16_master_resumed"] = resumed
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main(
        Path(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        int(sys.argv[4]),
        int(sys.argv[5]) if len(sys.argv) > 5 else 64,
    )
