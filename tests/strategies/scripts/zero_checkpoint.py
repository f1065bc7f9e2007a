"""Worker for checkpoint tests (run under torchrun with 2 ranks).

modes:
  resume OUT NAME  - uninterrupted 2-epoch run vs. 1 epoch + resume from `ckpt_path="last"`; then validate / test /
                     predict after fit on the same engine. Writes weights and facts to OUT (rank 0).
  crash OUT NAME   - save a complete checkpoint, then die on rank 1 in the middle of saving the next one.
  save_error OUT NAME - save a complete checkpoint, then fail on rank 0 while preparing the next one.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401
from _support.models import RegressionModule, full_state_dict, make_regression_data
from _support.trainers import quiet_trainer

EPOCHS = 2


def loader(shuffle: bool = False) -> DataLoader:
    return DataLoader(make_regression_data(), batch_size=4, shuffle=shuffle)


def trainer(name: str, root: Path, *, enable_checkpointing: bool = True, **kwargs) -> L.Trainer:
    return quiet_trainer(
        strategy=name,
        accelerator="cpu",
        devices=2,
        default_root_dir=root,
        enable_checkpointing=enable_checkpointing,
        **kwargs,
    )


def resume(out: Path, name: str) -> None:
    L.seed_everything(0, verbose=False)
    full = trainer(name, out / "full", max_epochs=EPOCHS, enable_checkpointing=False)
    full.fit(RegressionModule(), loader())
    full_weights = full_state_dict(full.strategy.deepspeed_engine.module)

    L.seed_everything(0, verbose=False)
    ckpt_dir = out / "ckpts"
    first = trainer(name, out / "part", max_epochs=1, callbacks=[ModelCheckpoint(ckpt_dir, save_last=True)])
    first.fit(RegressionModule(), loader())

    L.seed_everything(0, verbose=False)
    model = RegressionModule()
    second = trainer(name, out / "part", max_epochs=EPOCHS, callbacks=[ModelCheckpoint(ckpt_dir, save_last=True)])
    second.fit(model, loader(), ckpt_path="last")
    engine = second.strategy.deepspeed_engine
    resumed_weights = full_state_dict(engine.module)

    # evaluation after fit: same engine, no second one
    val = second.validate(model, loader(), verbose=False)[0]
    same_engine_validate = second.strategy.deepspeed_engine is engine
    test = second.test(model, loader(), verbose=False)[0]
    predictions = second.predict(model, loader())
    same_engine_predict = second.strategy.deepspeed_engine is engine
    if second.is_global_zero:
        torch.save(
            {"full": full_weights, "resumed": resumed_weights, "predictions": torch.cat(predictions)},
            out / "weights.pt",
        )
        (out / "facts.json").write_text(
            json.dumps(
                {
                    "full_step": full.global_step,
                    "resumed_step": second.global_step,
                    "val_loss": val["val_loss"],
                    "test_loss": test["test_loss"],
                    "same_engine_validate": same_engine_validate,
                    "same_engine_predict": same_engine_predict,
                    "checkpoints": sorted(p.name for p in ckpt_dir.iterdir()),
                }
            )
        )


def crash(out: Path, name: str) -> None:
    L.seed_everything(0, verbose=False)
    target = out / "model.ckpt"
    run = trainer(name, out, max_epochs=1, enable_checkpointing=False)
    run.fit(RegressionModule(), loader())
    run.save_checkpoint(target)  # complete
    engine = run.strategy.deepspeed_engine
    original = engine.save_checkpoint

    def dying_save(*args, **kwargs):
        result = original(*args, **kwargs)
        if run.global_rank == 1:
            os._exit(17)  # rank 1 dies after writing its files, before the checkpoint is committed
        return result

    engine.save_checkpoint = dying_save
    run.fit_loop.epoch_progress.current.completed = 99  # makes the second checkpoint distinguishable
    run.save_checkpoint(target)  # never returns normally: torchrun tears the job down


def save_error(out: Path, name: str) -> None:
    """Rank 0 cannot create the staging directory (permissions): every rank must raise instead of waiting for it."""
    from lightspeed.core.reliability import staging as atomic_dir

    L.seed_everything(0, verbose=False)
    target = out / "model.ckpt"
    run = trainer(name, out, max_epochs=1, enable_checkpointing=False)
    run.fit(RegressionModule(), loader())
    run.save_checkpoint(target)

    def failing_prepare(path):
        raise PermissionError(13, "Permission denied", str(path))

    atomic_dir.prepare_staging = failing_prepare  # only rank 0 prepares
    try:
        run.save_checkpoint(target)
        outcome = "saved"
    except Exception as err:  # noqa: BLE001 - the test reads what each rank saw
        outcome = f"{type(err).__name__}: {err}"
    (out / f"rank{run.global_rank}.txt").write_text(outcome)


if __name__ == "__main__":
    mode, out, name = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    out.mkdir(parents=True, exist_ok=True)
    {"resume": resume, "crash": crash, "save_error": save_error}[mode](out, name)
