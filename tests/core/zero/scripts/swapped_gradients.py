"""Worker: a layer some micro-batches skip, 1024 wide (its gradient slots span whole pages and are large enough for
DeepSpeed to swap them to NVMe), trained with accumulation over 2 and AdamW under the Trainer's ``zero3_nvme`` on 2
CPU ranks. Each rank records, before each optimizer step (after the window's closing backward swapped the gradients
out) and after the fit, how much of DeepSpeed's gradient partition buffer is resident.

Rank 0 writes OUT/result.pt: the gathered weights, and every rank's record (gathered).

usage: swapped_gradients.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401  (registers the strategy names)
from _support import model_shapes as ms
from _support.models import full_state_dict
from _support.process_memory import resident_bytes
from _support.trainers import quiet_trainer

WIDTH, EPS = ms.WIDE, ms.WIDE_EPS


class SometimesSkippedModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = ms.SometimesSkipped(WIDTH)
        self.before_steps: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x, ms.uses_skippable(batch_idx)), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.before_steps.append(resident_bytes(self.gradient_buffer()))

    def gradient_buffer(self) -> torch.Tensor:
        return self.trainer.strategy.deepspeed_engine.optimizer.grad_partitions_flat_buffer

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return ms.skip_optimizer(self.model.parameters(), eps=EPS)


def main() -> None:
    out = Path(sys.argv[1])
    module = SometimesSkippedModule()
    trainer = quiet_trainer(
        strategy="zero3_nvme", accelerator="cpu", devices=2, max_epochs=1, accumulate_grad_batches=2
    )
    trainer.fit(module, DataLoader(ms.skip_data(WIDTH), batch_size=ms.SKIP_BATCH))
    buffer = module.gradient_buffer()
    record = {"before_steps": module.before_steps, "after_fit": resident_bytes(buffer), "bytes": buffer.nbytes}
    records: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(records, record)
    weights = full_state_dict(module.model)
    if trainer.is_global_zero:
        torch.save({"weights": weights, "records": records}, out / "result.pt")


if __name__ == "__main__":
    main()
