"""Worker: train with Trainer(strategy=ZeroAutoStrategy(...)) for each case of a JSON list, on the ranks of one
launch; rank 0 saves the gathered weights, the chosen option, the resolved config and the logged plan.

usage: zero_auto_train.py OUT_DIR CASES_JSON [--steps K] [--batch B]
CASES_JSON: [{"name": ..., "model": "regression" | "deep" | "deep_configure", "kwargs": {...}}, ...]
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401  (registers the strategy names)
from _support.models import RegressionModule, full_state_dict, make_regression_data
from _support.trainers import quiet_trainer
from lightspeed.core.errors import MemoryPlanError
from lightspeed.strategies.zero_auto import ZeroAutoStrategy
from strategies.scripts.zero_auto_models import DeepRegressionModule


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def build(model: str) -> L.LightningModule:
    if model == "regression":
        return RegressionModule()
    return DeepRegressionModule(in_configure_model=model == "deep_configure")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("cases")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    capture = Capture()
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(capture)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.INFO)

    for case in json.loads(args.cases):
        L.seed_everything(0, verbose=False)
        capture.messages.clear()
        model = build(case["model"])
        strategy = ZeroAutoStrategy(**case["kwargs"])
        trainer = quiet_trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=2,
            max_steps=args.steps,
        )
        meta: dict = {"name": case["name"]}
        try:
            trainer.fit(model, DataLoader(make_regression_data(), batch_size=args.batch))
        except MemoryPlanError as error:
            meta["error"] = str(error)
        else:
            weights = full_state_dict(trainer.strategy.deepspeed_engine.module)
            inner = getattr(
                trainer.strategy.deepspeed_engine.optimizer, "optimizer", trainer.strategy.deepspeed_engine.optimizer
            )
            meta.update(
                chosen=strategy.chosen_option.name,
                config=strategy.resolved_config,
                optimizer=type(inner).__name__,
                global_step=trainer.global_step,
                world_size=trainer.world_size,
                plan_cluster=[strategy.memory_plan.cluster.devices_per_node, strategy.memory_plan.cluster.nodes],
                plan_counts=[
                    strategy.memory_plan.counts.total_params,
                    strategy.memory_plan.counts.largest_layer_params,
                ],
                plan_budgets=[strategy.memory_plan.budgets.device_memory, strategy.memory_plan.budgets.host_memory],
                plan_accumulation=strategy.memory_plan.accounting.accumulate_grad_batches,
                logged=[m for m in capture.messages if "zero_auto" in m],
            )
            if trainer.is_global_zero:
                torch.save(weights, args.out / f"{case['name']}.pt")
        if trainer.is_global_zero:
            (args.out / f"{case['name']}.json").write_text(json.dumps(meta, default=str))


if __name__ == "__main__":
    main()
