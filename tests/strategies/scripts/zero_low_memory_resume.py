"""Worker: resuming Trainer runs with DeepSpeed's low-memory bf16 states (bf16-mixed, 2 CPU ranks).

usage: zero_low_memory_resume.py OUT

For each variant (bf16 master weights with fp32 moments in DeepSpeed's CPU Adam under ZeRO-2 and ZeRO-3 with the
optimizer offloaded; bf16 master weights and moments under ZeRO-3): STEPS steps uninterrupted, then SAVE_AT steps
saving OUT/<variant>.ckpt and a new Trainer resuming it to STEPS. Then a copy of the ZeRO-2 checkpoint whose marker
says 4 processes wrote it (OUT/four.ckpt) is resumed. Rank 0 writes OUT/weights.pt (per variant, both runs' final
weights); every rank OUT/errors_<rank>.json (what the resume from four.ckpt raised).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightspeed  # noqa: F401  (registers the strategy names)
from _support.models import full_state_dict
from _support.outcomes import error_text
from _support.trainers import quiet_trainer
from lightspeed.core.reliability.staging import COMPLETE_MARKER
from lightspeed.strategies import ZeroStrategy

STEPS, SAVE_AT = 6, 3
MASTER = {"bf16_master_weights_and_grads": True}
VARIANTS: dict[str, dict[str, Any]] = {
    "zero2_offload_master": {"stage": 2, "offload_optimizer": "cpu", **MASTER},
    "zero3_offload_master": {"stage": 3, "offload_optimizer": "cpu", **MASTER},
    "zero3_master_and_states": {"stage": 3, **MASTER, "bf16_optimizer_states": True},
}


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, eps=1e-3)


def fit(variant: str, steps: int, save: Path | None = None, ckpt_path: Path | None = None) -> dict[str, torch.Tensor]:
    callbacks = [ModelCheckpoint(save.parent, filename=save.stem, every_n_train_steps=steps)] if save else []
    trainer = quiet_trainer(
        strategy=ZeroStrategy(**VARIANTS[variant]), accelerator="cpu", devices=2, precision="bf16-mixed",
        max_steps=steps, callbacks=callbacks, enable_checkpointing=bool(callbacks),
    )  # fmt: skip
    module = Regressor()
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 16, generator=generator), torch.randn(64, 4, generator=generator))
    trainer.fit(module, DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    return full_state_dict(module)


def main(out: Path) -> None:
    weights = {}
    for variant in VARIANTS:
        full = fit(variant, STEPS)
        fit(variant, SAVE_AT, save=out / f"{variant}.ckpt")
        weights[variant] = (full, fit(variant, STEPS, ckpt_path=out / f"{variant}.ckpt"))
    rank = torch.distributed.get_rank()
    four = out / "four.ckpt"
    if rank == 0:
        shutil.copytree(out / "zero2_offload_master.ckpt", four)
        marker = four / COMPLETE_MARKER
        marker.write_text(json.dumps({**json.loads(marker.read_text()), "world_size": 4}))
    torch.distributed.barrier()
    resharded = error_text(lambda: fit("zero2_offload_master", STEPS, ckpt_path=four))
    (out / f"errors_{rank}.json").write_text(json.dumps({"resharded": resharded}))
    if rank == 0:
        torch.save(weights, out / "weights.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
