"""Worker (torchrun, 2 ranks): the optimizer and scheduler come from the DeepSpeed config, ``configure_optimizers``
returns nothing, ``"auto"`` values are resolved (the scheduler's peak LR from the config's optimizer, its length
from the Trainer). Rank 0 writes OUT/<strategy>.pt (weights) and OUT/<strategy>.json (LR, resolved scheduler).

usage: zero_config_optimizer.py OUT STEPS NAME[,NAME...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from _support.models import RegressionModule, full_state_dict, make_regression_data
from _support.trainers import quiet_trainer
from lightspeed.strategies import ZeroStrategy

OPTIMIZER = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}}
SCHEDULER = {
    "type": "WarmupDecayLR",
    "params": {"warmup_min_lr": 0.0, "warmup_max_lr": "auto", "warmup_num_steps": 2, "total_num_steps": "auto"},
}


class ConfigOptimizerModule(RegressionModule):
    def configure_optimizers(self):
        return None  # the DeepSpeed config defines them


def main(out: Path, steps: int, names: list[str]) -> None:
    for name in names:
        L.seed_everything(0, verbose=False)
        strategy = ZeroStrategy(stage=int(name[-1]), config={"optimizer": OPTIMIZER, "scheduler": SCHEDULER})
        trainer = quiet_trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=2,
            max_steps=steps,
        )
        trainer.fit(ConfigOptimizerModule(), DataLoader(make_regression_data(), batch_size=4))
        engine = trainer.strategy.deepspeed_engine
        weights = full_state_dict(engine.module)
        if trainer.is_global_zero:
            torch.save(weights, out / f"{name}.pt")
            facts = {
                "global_step": trainer.global_step,
                "lr": [group["lr"] for group in engine.optimizer.param_groups],
                "scheduler": trainer.strategy.config["scheduler"],
            }
            (out / f"{name}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","))
