"""Worker for the elastic-restart tests, run under ``torchrun --nproc-per-node 2 --max-restarts N``.

usage: elastic_fit.py OUT STRATEGY FAULTS

FAULTS is a comma-separated list ``attempt:fault`` (fault: ``step`` - rank 1 SIGKILLed at the start of batch 5 of
epoch 1; ``save`` - rank 1 dies after writing its shard of the step-15 checkpoint, before the commit; ``val`` -
rank 1 SIGKILLed during the validation of epoch 2). Every attempt resumes with ``ckpt_path="last"`` (no checkpoint
yet: a fresh start). The finishing attempt also trains the same model uninterrupted in the same processes and rank 0
writes both final weights to OUT/weights.pt. Rank 0 appends where each attempt started to OUT/attempts.jsonl.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401
from _support.models import RegressionModule, full_state_dict, make_regression_data
from _support.trainers import quiet_trainer

EPOCHS = 3  # 8 steps per epoch (64 samples, batch 4, 2 ranks)
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Faults(Callback):
    def __init__(self, fault: str | None, out: Path) -> None:
        self.fault, self.out = fault, out

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            loop = trainer.fit_loop.epoch_loop
            found = sorted(p.name for p in (self.out / "ckpts").iterdir()) if (self.out / "ckpts").is_dir() else []
            record = {
                "attempt": ATTEMPT,
                "global_step": trainer.global_step,
                "batch": loop.batch_progress.current.ready,
                "checkpoints": found,
            }
            with (self.out / "attempts.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.fault == "save" and trainer.global_rank == 1:
            engine = trainer.strategy.deepspeed_engine
            original = engine.save_checkpoint

            def dying_save(*args: Any, **kwargs: Any) -> Any:
                result = original(*args, **kwargs)
                if trainer.global_step == 15:
                    os._exit(17)  # shard written, checkpoint not committed
                return result

            engine.save_checkpoint = dying_save

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self.fault == "step" and trainer.global_rank == 1 and trainer.current_epoch == 1 and idx == 5:
            die()

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.fault == "val" and trainer.global_rank == 1 and trainer.current_epoch == 2:
            die()


def loader() -> DataLoader:
    return DataLoader(make_regression_data(), batch_size=4, shuffle=True)


def trainer(strategy: str, root: Path, callbacks: list[Callback]) -> L.Trainer:
    return quiet_trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=EPOCHS,
        num_sanity_val_steps=0,
        default_root_dir=root,
        callbacks=callbacks,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    )


def weights(run: L.Trainer) -> dict[str, torch.Tensor]:
    return full_state_dict(run.lightning_module)


def main(out: Path, strategy: str, faults: str) -> None:
    plan = dict(item.split(":") for item in faults.split(",") if item)
    fault = plan.get(str(ATTEMPT))
    L.seed_everything(0, verbose=False)
    checkpoints = ModelCheckpoint(out / "ckpts", save_last=True, every_n_train_steps=3)
    elastic = trainer(strategy, out / "elastic", [checkpoints, Faults(fault, out)])
    elastic.fit(RegressionModule(), loader(), loader(), ckpt_path="last")
    resumed = weights(elastic)

    L.seed_everything(0, verbose=False)
    reference = trainer(strategy, out / "reference", [])
    reference.fit(RegressionModule(), loader(), loader())
    expected = weights(reference)  # a collective under ZeRO-3: every rank gathers
    if reference.is_global_zero:
        torch.save({"elastic": resumed, "reference": expected, "steps": elastic.global_step}, out / "weights.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "")
