"""Worker for storage faults (torchrun --max-restarts 1, 2 ranks, ZeRO-2, ``timeout=20s``); each rank writes what
it saw to OUT/attempt<A>_rank<R>.json.

1. attempt 0: a full disk while saving (``OSError(ENOSPC)`` raised in rank 1's write of its optimizer shard of the
   step-4 checkpoint): every rank fails, the step-2 checkpoint stays the last complete one; torchrun restarts, and
   ``fit(ckpt_path="last")`` resumes from step 2, its first save sweeping the half-written directory;
2. attempt 1, after finishing: a truncated shard (rank 1's optimizer file of the last checkpoint cut in half):
   resuming raises the same error on every rank, naming the file, before any step.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from _support.models import RegressionModule, make_regression_data
from _support.outcomes import Steps, error_text
from _support.trainers import quiet_trainer
from lightspeed.strategies import ZeroStrategy

TIMEOUT_S = 20


class FullDisk(Callback):
    """Rank 1's disk fills up while DeepSpeed writes its optimizer shard of the step-4 checkpoint."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank != 1:
            return
        checkpoint_engine = trainer.strategy.deepspeed_engine.checkpoint_engine
        original = checkpoint_engine.save

        def full_disk_save(state: Any, path: str, *args: Any, **kwargs: Any) -> Any:
            if trainer.global_step == 4 and "optim_states" in str(path):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return original(state, path, *args, **kwargs)

        checkpoint_engine.save = full_disk_save


def trainer(out: Path, max_steps: int, callbacks: list[Callback]) -> L.Trainer:
    return quiet_trainer(
        strategy=ZeroStrategy(stage=2, timeout=timedelta(seconds=TIMEOUT_S)),
        accelerator="cpu",
        devices=2,
        max_steps=max_steps,
        default_root_dir=out,
        callbacks=[ModelCheckpoint(out / "ckpts", save_last=True, every_n_train_steps=2), *callbacks],
        enable_checkpointing=True,
    )


def listing(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "ckpts").iterdir()) if (out / "ckpts").is_dir() else []


def main(out: Path) -> None:
    data = DataLoader(make_regression_data(), batch_size=4)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    L.seed_everything(0, verbose=False)
    steps = Steps()
    run = trainer(out, 6, [steps, FullDisk()] if attempt == 0 else [steps])
    facts: dict[str, Any] = {"attempt": attempt, "checkpoints_at_start": listing(out)}
    try:
        run.fit(RegressionModule(), data, ckpt_path="last")
    except Exception as err:
        facts["error"] = f"{type(err).__name__}: {err}".splitlines()[0]
        (out / f"attempt{attempt}_rank{run.global_rank}.json").write_text(json.dumps(facts, indent=1))
        raise
    facts["resumed_from"] = steps.first_step
    facts["final_step"] = run.global_step
    torch.distributed.barrier()
    facts["after_resume"] = listing(out)

    shard = out / "ckpts" / "last.ckpt" / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.distributed.barrier()
    if run.global_rank == 0:
        with shard.open("r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    torch.distributed.barrier()
    steps = Steps()
    damaged = trainer(out, 8, [steps])
    facts["truncated"] = error_text(lambda: damaged.fit(RegressionModule(), data, ckpt_path="last"))
    facts["truncated_batches"] = steps.batches
    (out / f"attempt{attempt}_rank{run.global_rank}.json").write_text(json.dumps(facts, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
