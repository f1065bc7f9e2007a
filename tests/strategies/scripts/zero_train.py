"""Worker: train RegressionModule under several lightspeed strategies on the ranks of one launch and save the
gathered weights (rank 0) for comparison with a single-process reference.

usage: zero_train.py OUT_DIR NAME[,NAME...] [--steps K] [--devices N] [--batch B]
Each NAME is a registered strategy name (zero1, zero3_offload, ...), optionally with a precision: zero2@bf16-mixed.
The JSON beside the weights records the steps fp16 loss scaling skipped (``skipped``, from 0) and the final scale.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from deepspeed.accelerator import get_accelerator
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401  (registers the strategy names)
from _support.models import RegressionModule, full_state_dict, make_regression_data
from _support.trainers import quiet_trainer


class SkippedSteps(L.Callback):
    """The batches (from 0) whose optimizer step DeepSpeed skipped on fp16 overflow, from the engine's own count after
    every batch, and how many batches the run trained."""

    def __init__(self) -> None:
        self.skipped: list[int] = []
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.strategy.deepspeed_engine.skipped_steps > len(self.skipped):
            self.skipped.append(self.batches)
        self.batches += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("names")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    for run_name in args.names.split(","):
        name, _, precision = run_name.partition("@")
        L.seed_everything(0, verbose=False)
        model = RegressionModule()
        skipped = SkippedSteps()
        trainer = quiet_trainer(
            strategy=name,
            accelerator=args.accelerator,
            devices=args.devices,
            precision=precision or args.precision,
            max_steps=args.steps,
            callbacks=[skipped],
        )
        trainer.fit(model, DataLoader(make_regression_data(), batch_size=args.batch))
        module = trainer.strategy.deepspeed_engine.module
        dtypes = sorted({str(p.dtype) for p in module.parameters()})
        weights = full_state_dict(module)
        optimizer = trainer.strategy.deepspeed_engine.optimizer
        inner = getattr(optimizer, "optimizer", optimizer)
        if trainer.is_global_zero:
            torch.save(weights, args.out / f"{run_name}.pt")
            (args.out / f"{run_name}.json").write_text(
                json.dumps(
                    {
                        "param_dtypes": dtypes,
                        "cuda_initialized": torch.cuda.is_initialized(),
                        # Lightning's Trainer itself creates a CUDA context wherever a GPU is visible (the RNG
                        # states it saves around the sanity check): what counts is that nothing is put on it
                        "cuda_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else 0,
                        "deepspeed_accelerator": get_accelerator()._name,
                        "world_size": trainer.world_size,
                        "global_step": trainer.global_step,
                        "optimizer": type(inner).__name__,
                        "skipped": skipped.skipped,
                        "batches": skipped.batches,
                        "loss_scale": getattr(optimizer, "loss_scale", None),
                        "device": str(next(module.parameters()).device),
                        "config": trainer.strategy.resolved_config,
                    },
                    default=str,
                )
            )


if __name__ == "__main__":
    main()
