"""Worker: torch optimizers other than Adam/AdamW under optimizer offload (run under torchrun with 2 ranks).

usage: zero_any_optimizer.py OUT RUN[,RUN...] [--steps K]
RUN is OPTIMIZER@STRATEGY: sgd (SGD with momentum and a per-step LR scheduler), adagrad (Adagrad, same scheduler)
or lbfgs (refused: its error is written to OUT/RUN.error.rankR.txt). Weights (rank 0) go to OUT/RUN.pt, facts to
OUT/RUN.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401
from _support.models import RegressionModule, full_state_dict, make_regression_data
from _support.trainers import quiet_trainer


def make_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=0.05, weight_decay=0.01)
    if kind == "lbfgs":
        return torch.optim.LBFGS(params, lr=0.1)
    raise ValueError(kind)


def make_scheduler(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


class Module(RegressionModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def configure_optimizers(self):
        optimizer = make_optimizer(self.kind, self.parameters())
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": make_scheduler(optimizer), "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("runs")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for run in args.runs.split(","):
        kind, _, name = run.partition("@")
        L.seed_everything(0, verbose=False)
        model = Module(kind)
        trainer = quiet_trainer(
            strategy=name,
            accelerator="cpu",
            devices=2,
            max_steps=args.steps,
        )
        try:
            trainer.fit(model, DataLoader(make_regression_data(), batch_size=4))
        except Exception as err:  # noqa: BLE001 - the test reads the message
            (args.out / f"{run}.error.rank{trainer.global_rank}.txt").write_text(f"{type(err).__name__}: {err}")
            continue
        engine = trainer.strategy.deepspeed_engine
        weights = full_state_dict(engine.module)
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        if trainer.is_global_zero:
            torch.save(weights, args.out / f"{run}.pt")
            (args.out / f"{run}.json").write_text(
                json.dumps(
                    {
                        "global_step": trainer.global_step,
                        "optimizer": type(inner).__name__,
                        "lr": [group["lr"] for group in inner.param_groups],
                        "force_ds_cpu_optimizer": trainer.strategy.config.get("zero_force_ds_cpu_optimizer"),
                    }
                )
            )


if __name__ == "__main__":
    main()
