"""Worker: a Trainer run under ``zero3_nvme`` (2 CPU ranks) saves a checkpoint after 2 steps; its engine is asked to
load it directly (what node-local and several-model resumes do), then a new Trainer under the same strategy is asked
to resume from it. Each rank writes OUT/result_<rank>.json: the two errors it raised (or None).

usage: zero_nvme_resume.py OUT
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401  (registers the strategy names)
from _support.models import RegressionModule, make_regression_data
from _support.trainers import quiet_trainer
from lightspeed.errors import CheckpointError


def main(out: Path) -> None:
    loader = DataLoader(make_regression_data(), batch_size=4)
    common = {"strategy": "zero3_nvme", "accelerator": "cpu", "devices": 2}
    saver = ModelCheckpoint(dirpath=out, filename="mid", every_n_train_steps=2, save_top_k=-1)
    first = quiet_trainer(**common, max_steps=2, callbacks=[saver], enable_checkpointing=True)
    first.fit(RegressionModule(), loader)
    checkpoint = out / "mid.ckpt"
    errors = [
        error_of(lambda: first.strategy.deepspeed_engine.load_checkpoint(str(checkpoint), tag="checkpoint")),
        error_of(lambda: quiet_trainer(**common, max_steps=4).fit(RegressionModule(), loader, ckpt_path=checkpoint)),
    ]
    (out / f"result_{first.global_rank}.json").write_text(json.dumps(errors))


def error_of(call: Callable[[], Any]) -> str | None:
    try:
        call()
    except CheckpointError as raised:
        return f"{type(raised).__name__}: {raised}"
    return None


if __name__ == "__main__":
    main(Path(sys.argv[1]))
