"""Worker for the hang test (torchrun, 2 ranks): rank 1 stops itself (SIGSTOP) at batch 3; rank 0 must fail within
the strategy's ``timeout=`` with an error naming the collective and rank 1, written to OUT/rank0_error.txt. With
HOW ``exits``, rank 1 fails instead (an exception at batch 3, its process ends) and rank 0 must name it as gone.
STRATEGY ``predict_zero3``: no rank stops, but under ZeRO-3 ``predict_step`` calls a collective of its own on rank 0
only (at batch 1); the rank that waits fails with its error in OUT/rank<r>_error.txt.

usage: hang.py OUT STRATEGY TIMEOUT_S [HOW: stops (default) | exits]
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

import lightspeed
from _support.models import RegressionModule, make_regression_data
from _support.trainers import quiet_trainer


class StopRankOne(Callback):
    def __init__(self, out: Path, how: str) -> None:
        self.out, self.how = out, how

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_rank == 1 and idx == 3:
            if self.how == "exits":
                raise RuntimeError("rank 1 fails on purpose")
            (self.out / "stopped_pid.txt").write_text(str(os.getpid()))  # the test kills it once rank 0 failed
            os.kill(os.getpid(), signal.SIGSTOP)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if trainer.global_rank == 0 and self.how == "exits":
            # torchrun's SIGTERM, sent once rank 1 ended, at the worst moment: while the error is being handled,
            # before the strategy names it (Lightning's handler then broadcasts on the broken group)
            os.kill(os.getpid(), signal.SIGTERM)


class OneRankCollective(RegressionModule):
    """A user's own collective in ``predict_step``, on rank 0 only: the other rank never joins it."""

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_rank == 0 and batch_idx == 1:
            torch.distributed.all_reduce(torch.ones(1))
        return super().predict_step(batch, batch_idx)


def predict_with_one_rank_collective(out: Path, timeout: timedelta) -> None:
    strategy = lightspeed.strategies.ZeroStrategy(stage=3, timeout=timeout)
    trainer = quiet_trainer(
        strategy=strategy, accelerator="cpu", devices=2, enable_checkpointing=True, enable_model_summary=True
    )
    try:
        trainer.predict(OneRankCollective(), DataLoader(make_regression_data(32), batch_size=4))
    except BaseException as err:
        (out / f"rank{trainer.global_rank}_error.txt").write_text(
            f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
        )
        raise
    (out / f"finished{trainer.global_rank}.txt").write_text("no error")


def main(out: Path, name: str, timeout_s: float, how: str) -> None:
    timeout = timedelta(seconds=timeout_s)
    if name == "predict_zero3":
        predict_with_one_rank_collective(out, timeout)
        return
    if name == "ddp_exact":
        strategy: Any = lightspeed.strategies.DDPExactStrategy(timeout=timeout)
    else:
        strategy = lightspeed.strategies.ZeroStrategy(stage=2, timeout=timeout)
    L.seed_everything(0, verbose=False)
    trainer = quiet_trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        callbacks=[StopRankOne(out, how)],
    )
    try:
        trainer.fit(RegressionModule(), DataLoader(make_regression_data(), batch_size=4))
    except BaseException as err:
        if trainer.global_rank == 0:
            (out / "rank0_error.txt").write_text(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        raise
    (out / f"finished{trainer.global_rank}.txt").write_text("no error")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "stops")
