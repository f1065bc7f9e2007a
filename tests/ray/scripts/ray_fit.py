"""Driver: a Ray Train ``TorchTrainer`` (2 CPU workers) whose training function builds the Trainer as Ray's Lightning
guide writes it (``RayLightningEnvironment``, ``RayTrainReportCallback``, ``prepare_trainer``) with
``RayZeroStrategy(stage=STAGE)``, resuming from ``ray.train.get_checkpoint()`` when Ray restarts it.

usage: ray_fit.py OUT STAGE EPOCHS [FAULT]

FAULT ``kill``: in the first attempt, rank 1 ends its process at the start of epoch 1, once Ray has registered the
checkpoint of epoch 0; ``FailureConfig(max_failures=1)`` restarts the workers. Rank 0 of the last attempt writes the
gathered weights to OUT/weights.pt and OUT/result.json (the epoch it resumed from, the global step, Ray's result).
FAULT ``hang`` (tests/_support/ray_train.py): the process group's timeout is HANG_TIMEOUT_S, rank 1 stops its process
at the start of step HANG_STEP, no restart; each rank that raises writes OUT/error_rank<R>.json, the driver what
``TorchTrainer.fit`` raised to OUT/driver_error.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import ray
import torch
from torch.utils.data import DataLoader

from _support.ray_train import (
    record_error,
    run_torch_trainer,
    stop_rank_one_at_hang_step,
    wait_for_registered_checkpoint,
)


class KillRankOne(L.Callback):
    """Rank 1 leaves the job at the start of epoch 1, once Ray registered epoch 0's checkpoint."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 1 and trainer.current_epoch == 1:
            wait_for_registered_checkpoint(self.out)
            os._exit(1)


class StopRankOne(L.Callback):
    """The ``hang`` fault: rank 1 stops its process at the start of step HANG_STEP."""

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        stop_rank_one_at_hang_step(trainer.global_rank, trainer.global_step)


def record_saves(trainer: L.Trainer, out: Path) -> None:
    """After each checkpoint save, the files this rank's save directory holds, appended to
    OUT/saves_rank<R>.jsonl (RayTrainReportCallback deletes the directory once Ray has it)."""
    strategy, save = trainer.strategy, trainer.strategy.save_checkpoint

    def save_and_record(checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        save(checkpoint, filepath, storage_options)
        files = sorted(str(p.relative_to(filepath)) for p in Path(filepath).rglob("*") if p.is_file())
        with (out / f"saves_rank{trainer.global_rank}.jsonl").open("a") as log:
            log.write(json.dumps({"path": str(filepath), "files": files}) + "\n")

    strategy.save_checkpoint = save_and_record  # type: ignore[method-assign]


def train_func(config: dict[str, Any]) -> None:
    from ray.train.lightning import RayLightningEnvironment, RayTrainReportCallback, prepare_trainer

    from _support.models import RegressionModule, full_state_dict, make_regression_data
    from _support.trainers import quiet_trainer
    from lightspeed.ray import RayZeroStrategy

    out = Path(config["out"])
    checkpoint = ray.train.get_checkpoint()
    callbacks: list[L.Callback] = [RayTrainReportCallback()]
    if config["fault"] == "kill" and checkpoint is None:
        callbacks.append(KillRankOne(out))
    if config["fault"] == "hang":
        callbacks.append(StopRankOne())
    L.seed_everything(0, verbose=False)
    trainer = quiet_trainer(
        strategy=RayZeroStrategy(stage=config["stage"]),
        accelerator="cpu",
        devices="auto",
        plugins=[RayLightningEnvironment()],
        callbacks=callbacks,
        max_epochs=config["epochs"],
    )
    trainer = prepare_trainer(trainer)
    record_saves(trainer, out)
    loader = DataLoader(make_regression_data(), batch_size=4)
    try:
        if checkpoint is None:
            trainer.fit(RegressionModule(), loader)
            resumed_from = None
        else:
            with checkpoint.as_directory() as directory:
                complete = Path(directory) / "checkpoint.ckpt" / "lightspeed_complete.json"
                resumed_from = json.loads(complete.read_text())
                trainer.fit(RegressionModule(), loader, ckpt_path=str(Path(directory) / "checkpoint.ckpt"))
    except BaseException as error:
        record_error(out / f"error_rank{trainer.global_rank}.json", error)
        raise
    weights = full_state_dict(trainer.strategy.deepspeed_engine.module)
    if trainer.global_rank == 0:
        torch.save(weights, out / "weights.pt")
        (out / "result.json").write_text(
            json.dumps(
                {
                    "global_step": trainer.global_step,
                    "resumed_from_step": None if resumed_from is None else resumed_from["global_step"],
                    "strategy_classes": [cls.__name__ for cls in type(trainer.strategy).__mro__],
                }
            )
        )


def main() -> None:
    out, stage, epochs = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    fault = sys.argv[4] if len(sys.argv) > 4 else "none"
    run_torch_trainer(train_func, {"stage": stage, "epochs": epochs, "fault": fault}, out)


if __name__ == "__main__":
    main()
