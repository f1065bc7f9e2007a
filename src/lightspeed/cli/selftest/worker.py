"""One rank of ``lightspeed test``: ``torchrun ... -m lightspeed.cli.selftest.worker OUT_DIR --strategy ...`` trains
a tiny model for a few steps through the Trainer and writes what it saw (ranks, losses, weight and RNG digests) to
``OUT_DIR/rank<N>.json`` for the command to compare."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

SEED = 1234


def _digest(tensors: list[Any]) -> str:
    sha = hashlib.sha256()
    for tensor in tensors:
        sha.update(tensor.detach().to("cpu").float().contiguous().numpy().tobytes())
    return sha.hexdigest()


def _full_weights_digest(module: Any) -> str:
    """sha256 of every parameter in full, gathering ZeRO-3 partitions first (a collective: every rank calls it)."""

    params = list(module.parameters())
    context = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        context = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    with context:
        tensors = [p.detach().clone() for p in params]
    return _digest(tensors)


def _rng_draws() -> dict[str, list[float]]:
    import random

    import numpy as np
    import torch

    state = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    draws = {
        "torch": torch.rand(3).tolist(),
        "numpy": np.random.rand(3).tolist(),
        "python": [random.random() for _ in range(3)],
    }
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])
    return draws


def run_worker(args: argparse.Namespace) -> None:
    """Train the probe model on this rank and write what it saw to ``OUT_DIR/rank<N>.json``."""
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightspeed  # noqa: F401 - registers the strategy names

    out_dir = Path(args.out_dir)
    L.seed_everything(SEED, verbose=False)
    rng_after_seed = _rng_draws()

    class Probe(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 4))
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss.detach().float()))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    model = Probe()
    initial = _digest(list(model.parameters()))
    generator = torch.Generator().manual_seed(SEED)
    data = TensorDataset(torch.randn(64, 16, generator=generator), torch.randn(64, 4, generator=generator))
    accelerator = "cuda" if args.accelerator in ("cuda", "gpu") else "cpu"
    trainer = L.Trainer(
        strategy=args.strategy,
        accelerator=accelerator,
        devices=args.devices,
        max_steps=args.steps,
        precision=args.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
    rng_after_training = torch.get_rng_state()
    final = _full_weights_digest(model)
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "strategy": type(trainer.strategy).__name__,
        "steps": trainer.global_step,
        "losses": model.losses,
        "initial_weights": initial,
        "final_weights": final,
        "rng_after_seed": rng_after_seed,
        "rng_after_training": hashlib.sha256(rng_after_training.numpy().tobytes()).hexdigest(),
    }
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m lightspeed.cli.selftest.worker")
    parser.add_argument("out_dir")
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--accelerator", required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--precision", required=True)
    return parser.parse_args(argv)


if __name__ == "__main__":
    run_worker(_parse(sys.argv[1:]))
