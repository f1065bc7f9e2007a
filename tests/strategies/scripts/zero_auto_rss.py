"""Worker: peak resident memory of short CPU ZeRO runs of a ~50M-parameter MLP, one ZeRO stage after another.

Each rank first warms every strategy up on a tiny model (so code, threads and DeepSpeed's caches are loaded), then
for each strategy: frees what it can, notes the resident memory as the baseline, resets the kernel's peak counter
(/proc/self/clear_refs), builds the model, trains 2 steps and reads the peak (VmHWM). Writes rank<N>.json.

usage: zero_auto_rss.py OUT_DIR STAGES --width W --depth D --batch B [--config JSON]
STAGES are ZeRO stages of a lightspeed ZeroStrategy, comma-separated ("2,3"), measured in that order in the same
processes (one launch instead of one per stage); --config is merged into each DeepSpeed config.
Writes rank<N>_stage<S>.json per stage.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightspeed  # noqa: F401  (registers the strategy names)
from _support.trainers import quiet_trainer


class WideMLP(L.LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def _release() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap pages back, so the baseline is what is live
    except OSError:
        pass


def _fit(stage: int, config: dict, model: L.LightningModule, width: int, batch: int, steps: int) -> L.Trainer:
    from lightspeed.strategies.zero import ZeroStrategy

    data = TensorDataset(torch.randn(batch * 2 * steps, width), torch.randn(batch * 2 * steps, width))
    trainer = quiet_trainer(
        strategy=ZeroStrategy(stage=stage, config=config),
        accelerator="cpu",
        devices=2,
        max_steps=steps,
    )
    trainer.fit(model, DataLoader(data, batch_size=batch))
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("stages", type=lambda text: [int(stage) for stage in text.split(",")])
    parser.add_argument("--config", default="{}")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    config = json.loads(args.config)
    rank = int(os.environ["RANK"])

    for stage in args.stages:
        _fit(stage, config, WideMLP(64, 2), 64, args.batch, 1)  # warm-up: same code paths, negligible memory
    for stage in args.stages:
        _release()
        baseline = _status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
        L.seed_everything(0, verbose=False)
        model = WideMLP(args.width, args.depth)
        trainer = _fit(stage, config, model, args.width, args.batch, 2)
        peak = _status_kib("VmHWM")
        result = {"stage": stage, "baseline_kib": baseline, "peak_kib": peak, "steps": trainer.global_step}
        (args.out / f"rank{rank}_stage{stage}.json").write_text(json.dumps(result))
        del model, trainer  # whatever of it stays referenced is in the next baseline


if __name__ == "__main__":
    main()
