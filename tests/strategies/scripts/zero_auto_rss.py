"""Worker: peak resident memory of short CPU ZeRO runs of an MLP, one ZeRO option after another.

Each rank first warms every option up on a tiny model (so code, threads and DeepSpeed's caches are loaded), then
for each option: frees what it can, notes the resident memory as the baseline, resets the kernel's peak counter,
builds the model, trains 2 steps and reads the peak (VmHWM).

usage: zero_auto_rss.py OUT_DIR OPTIONS --width W --depth D --batch B [--config JSON] [--nvme-path DIR]
OPTIONS are names of the planner's ZeRO options, comma-separated ("zero2,zero3,zero3_offload,zero3_nvme"),
measured in that order in the same processes (one launch instead of one per option); --config is merged into each
DeepSpeed config; --nvme-path is where zero3_nvme swaps. Writes rank<N>_<option>.json per option.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightspeed  # noqa: F401  (registers the strategy names)
from _support.process_memory import reset_peak, status_bytes
from _support.trainers import quiet_trainer
from lightspeed.core.zero.planner import ZERO_OPTIONS


class WideMLP(L.LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _release() -> None:
    from lightspeed.core.zero.release import EngineRecord

    EngineRecord.release_finished_but(None)  # the last run's engines (else released as the next run builds)
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap pages back, so the baseline is what is live
    except OSError:
        pass


def _fit(name: str, args: argparse.Namespace, model: L.LightningModule, width: int, steps: int) -> L.Trainer:
    from lightspeed.strategies.zero import ZeroStrategy

    option = next(option for option in ZERO_OPTIONS if option.name == name)
    nvme: dict[str, Any] = {}
    if "nvme" in (option.offload_optimizer, option.offload_parameters):
        nvme["nvme_path"] = args.nvme_path / f"rank{os.environ['RANK']}_{width}"
    strategy = ZeroStrategy(
        stage=option.stage,
        offload_optimizer=option.offload_optimizer,
        offload_parameters=option.offload_parameters,
        config=json.loads(args.config),
        **nvme,
    )
    batch = args.batch
    data = TensorDataset(torch.randn(batch * 2 * steps, width), torch.randn(batch * 2 * steps, width))
    trainer = quiet_trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=steps)
    trainer.fit(model, DataLoader(data, batch_size=batch))
    if nvme:
        shutil.rmtree(nvme["nvme_path"], ignore_errors=True)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("options", type=lambda text: text.split(","))
    parser.add_argument("--config", default="{}")
    parser.add_argument("--nvme-path", type=Path, default=None)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    args.nvme_path = args.nvme_path or args.out / "nvme"
    rank = int(os.environ["RANK"])

    for name in args.options:
        _fit(name, args, WideMLP(64, 2), 64, 1)  # warm-up: same code paths, negligible memory
    for name in args.options:
        _release()
        baseline = status_bytes("VmRSS")
        reset_peak()
        L.seed_everything(0, verbose=False)
        model = WideMLP(args.width, args.depth)
        trainer = _fit(name, args, model, args.width, 2)
        peak = status_bytes("VmHWM")
        result = {"option": name, "baseline_bytes": baseline, "peak_bytes": peak, "steps": trainer.global_step}
        (args.out / f"rank{rank}_{name}.json").write_text(json.dumps(result))
        del model, trainer  # whatever of it stays referenced after _release is in the next baseline


if __name__ == "__main__":
    main()
