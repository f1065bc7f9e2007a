"""Worker for bad-input cases (torchrun, 2 ranks, ZeRO-2); rank 0 writes what happened to OUT/facts.json.

* ``ckpt_path="last"`` with only an interrupted save (a staging directory) on disk: a fresh start with a warning
  naming it; the first save sweeps it;
* an explicit ``ckpt_path`` to that incomplete checkpoint: an error;
* resuming the checkpoint of another model (different shapes): one error listing every mismatched parameter, before
  any training step.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401
from _support.models import IN_FEATURES, OUT_FEATURES, RegressionModule, make_regression_data
from _support.outcomes import Steps, error_text
from _support.trainers import quiet_trainer


class WiderModule(RegressionModule):
    """Another model: its hidden layer has 41 units instead of 37."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN_FEATURES, 41), nn.Tanh(), nn.Linear(41, OUT_FEATURES))


def trainer(root: Path, max_steps: int, callbacks: list[Callback]) -> L.Trainer:
    return quiet_trainer(
        strategy="zero2",
        accelerator="cpu",
        devices=2,
        max_steps=max_steps,
        default_root_dir=root,
        callbacks=callbacks,
        enable_checkpointing=True,
    )


def main(out: Path) -> None:
    facts: dict[str, Any] = {}
    ckpts = out / "ckpts"
    staging = ckpts / "last.ckpt.lightspeed-staging"
    (staging / "checkpoint").mkdir(parents=True, exist_ok=True)  # what a save killed mid-write leaves
    data = DataLoader(make_regression_data(), batch_size=4)

    L.seed_everything(0, verbose=False)
    steps = Steps()
    run = trainer(out, 2, [ModelCheckpoint(ckpts, save_last=True, every_n_train_steps=2), steps])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(RegressionModule(), data, ckpt_path="last")
    facts["fresh_first_step"] = steps.first_step
    facts["warnings"] = [str(w.message) for w in caught if "lightspeed" in str(w.message)]
    facts["after_first_save"] = sorted(p.name for p in ckpts.iterdir())

    if run.global_rank == 0:  # rank 0 alone, so that no rank recreates it before rank 0 listed the directory
        staging.mkdir(exist_ok=True)  # another interrupted save
    explicit = trainer(out, 4, [])
    facts["explicit_incomplete"] = error_text(lambda: explicit.fit(RegressionModule(), data, ckpt_path=staging))

    other = Steps()
    wrong = trainer(out, 4, [other])
    facts["other_model"] = error_text(lambda: wrong.fit(WiderModule(), data, ckpt_path=ckpts / "last.ckpt"))
    facts["other_model_batches"] = other.batches
    if run.global_rank == 0:
        (out / "facts.json").write_text(json.dumps(facts, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
