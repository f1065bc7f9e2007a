"""Worker: Lightning's own `ddp` on 2 CPU ranks (gloo) in a script that imports lightspeed. An exit hook registered
before `import lightspeed` runs after lightspeed's (atexit runs hooks in reverse) and writes OUT_DIR/rank<R>.json:
whether the default process group still existed then.

usage: ddp_exit.py OUT_DIR
"""

from __future__ import annotations

import atexit
import json
import sys
from pathlib import Path

import torch.distributed as dist

OUT = Path(sys.argv[1])
RANK: list[int] = []


def report() -> None:
    if RANK:
        (OUT / f"rank{RANK[0]}.json").write_text(json.dumps({"group_alive": dist.is_initialized()}))


atexit.register(report)

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightspeed  # noqa: E402,F401
from _support.models import RegressionModule, make_regression_data  # noqa: E402
from _support.trainers import quiet_trainer  # noqa: E402


class RecordRank(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        RANK.append(trainer.global_rank)


if __name__ == "__main__":
    torch.manual_seed(0)
    trainer = quiet_trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_steps=2,
        callbacks=[RecordRank()],
    )
    trainer.fit(RegressionModule(), DataLoader(make_regression_data(), batch_size=4))
