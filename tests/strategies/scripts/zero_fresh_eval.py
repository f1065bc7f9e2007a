"""Worker: evaluation from a ZeRO checkpoint in a process that did not train (run under torchrun).

usage:
  zero_fresh_eval.py train OUT NAMES   - per name: fit, save OUT/ckpt/NAME/last.ckpt, then validate/test/predict on
                                         the training engine; results in OUT/train/
  zero_fresh_eval.py eval OUT NAMES TAG [--missing CKPT]
                                       - per name: a fresh Trainer (and a model with other initial weights) runs
                                         validate/test/predict with ckpt_path; results in OUT/TAG/. --missing:
                                         validate from a checkpoint lacking a rank file, each rank's error in
                                         OUT/TAG/missing.rankR.txt. Ends with a short fit + validate (the process
                                         group torn down by the evaluations must come back).
NAMES: comma-separated registered names; "stage0" is ZeroStrategy(stage=0).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401
from _support.models import RegressionModule, make_regression_data
from _support.trainers import quiet_trainer
from lightspeed.strategies import ZeroStrategy


def loader() -> DataLoader:
    return DataLoader(make_regression_data(), batch_size=4)


def strategy(name: str):
    return ZeroStrategy(stage=0) if name == "stage0" else name


def trainer(name: str, root: Path, *, enable_checkpointing: bool = True, **kwargs) -> L.Trainer:
    return quiet_trainer(
        strategy=strategy(name),
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        default_root_dir=root,
        enable_checkpointing=enable_checkpointing,
        **kwargs,
    )


def evaluate(run: L.Trainer, model: RegressionModule, out: Path, name: str, ckpt_path: str | None) -> dict:
    val = run.validate(model, loader(), ckpt_path=ckpt_path, verbose=False)[0]
    group_after_validate = dist.is_initialized()
    test = run.test(model, loader(), ckpt_path=ckpt_path, verbose=False)[0]
    predictions = run.predict(model, loader(), ckpt_path=ckpt_path)
    torch.save(torch.cat(predictions), out / f"{name}.rank{run.global_rank}.pt")
    return {
        "val_loss": val["val_loss"],
        "test_loss": test["test_loss"],
        "world_size": run.world_size,
        "group_after_validate": group_after_validate,
    }


def train(out: Path, names: list[str]) -> None:
    (out / "train").mkdir(parents=True, exist_ok=True)
    for name in names:
        L.seed_everything(0, verbose=False)
        model = RegressionModule()
        run = trainer(name, out / "root", max_epochs=1, enable_checkpointing=False)
        run.fit(model, loader())
        run.save_checkpoint(out / "ckpt" / name / "last.ckpt")
        facts = evaluate(run, model, out / "train", name, None)
        if run.is_global_zero:
            (out / "train" / f"{name}.json").write_text(json.dumps({**facts, "global_step": run.global_step}))


def evaluate_fresh(out: Path, names: list[str], tag: str, missing: str | None) -> None:
    target = out / tag
    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        L.seed_everything(0, verbose=False)
        model = RegressionModule(seed=7)  # other initial weights: only the checkpoint can make the results match
        run = trainer(name, out / "root")
        facts = evaluate(run, model, target, name, str(out / "ckpt" / name / "last.ckpt"))
        if run.is_global_zero:
            (target / f"{name}.json").write_text(json.dumps(facts))
    if missing is not None:
        run = trainer("zero2", out / "root")
        try:
            run.validate(RegressionModule(seed=7), loader(), ckpt_path=missing, verbose=False)
            outcome = "validated"
        except Exception as err:  # noqa: BLE001 - the test reads what each rank saw
            outcome = f"{type(err).__name__}: {err}"
        (target / f"missing.rank{run.global_rank}.txt").write_text(outcome)
    # a fit after all this: the process group destroyed at the end of the evaluations is created again
    L.seed_everything(0, verbose=False)
    model = RegressionModule()
    run = trainer("zero2", out / "root", max_steps=2, enable_checkpointing=False)
    run.fit(model, loader())
    val = run.validate(model, loader(), verbose=False)[0]
    if run.is_global_zero:
        (target / "refit.json").write_text(json.dumps({"global_step": run.global_step, "val_loss": val["val_loss"]}))


if __name__ == "__main__":
    mode, out, names = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(",")
    if mode == "train":
        train(out, names)
    else:
        missing = sys.argv[sys.argv.index("--missing") + 1] if "--missing" in sys.argv else None
        evaluate_fresh(out, names, sys.argv[4], missing)
