"""Worker: zero_auto's measured mode on the ranks of one launch (``ZeroAutoStrategy(tune=True)``).

usage: zero_auto_tune.py OUT_DIR
Phases, each a fit of 4 steps on shuffled data (seed 0) with the tuning cache OUT_DIR/cache.json:
  tuned      trials of zero1, zero2, zero3; the chosen option trains
  fixed      the chosen option as a fixed ZeroStrategy, untuned (the tuned run must equal it bit for bit)
  cached     tuned again: the decision comes from the cache, no trials
  retune     retune=True: trials again
  other      another model shape with the same cache: its decision is not reused
  attention  a model with nn.MultiheadAttention (which reads out_proj.weight outside its module): zero3 is measured
  bad        tune_options naming an unknown option; nothing fits
Rank 0 writes OUT_DIR/result.json (chosen options, logged lines per phase, errors) and OUT_DIR/<phase>.pt (weights).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401  (registers the strategy names)
from _support.models import IN_FEATURES, OUT_FEATURES, RegressionModule, full_state_dict, make_regression_data
from lightspeed.strategies import ZeroStrategy
from lightspeed.strategies.zero_auto import ZeroAutoStrategy
from strategies.scripts.zero_auto_models import DeepRegressionModule
from strategies.scripts.zero_auto_train import Capture

OPTIONS = ["zero1", "zero2", "zero3"]


class AttentionRegression(L.LightningModule):
    """Self-attention over one token per sample, then a linear head: under ZeRO-3 the attention reads its
    ``out_proj.weight`` without calling ``out_proj``, which DeepSpeed gathers only inside the engine's forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attention = nn.MultiheadAttention(IN_FEATURES, 1, batch_first=True)
        self.head = nn.Linear(IN_FEATURES, OUT_FEATURES)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        tokens = x[:, None]
        mixed, _ = self.attention(tokens, tokens, tokens)
        return nn.functional.mse_loss(self.head(mixed[:, 0]), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(strategy: Any, module: L.LightningModule) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(make_regression_data(), batch_size=4, shuffle=True))
    return trainer


def tuned(out: Path, **kwargs: Any) -> ZeroAutoStrategy:
    arguments = {"tune_steps": 2, "tune_options": OPTIONS, "tune_cache": out / "cache.json", "host_memory": "20GB"}
    return ZeroAutoStrategy(tune=True, **{**arguments, **kwargs})


def error_of(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test compares type and message
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "message": None}


def main(out: Path) -> None:
    capture = Capture()
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(capture)
    logger.setLevel(logging.INFO)
    result: dict[str, Any] = {"logs": {}, "chosen": {}}
    weights: dict[str, dict[str, torch.Tensor]] = {}

    def phase(name: str, strategy: Any, module: L.LightningModule | None = None) -> Any:
        capture.messages.clear()
        module = module or RegressionModule()
        fit(strategy, module)
        result["logs"][name] = [m for m in capture.messages if "zero_auto" in m]
        chosen = getattr(strategy, "chosen_option", None)
        result["chosen"][name] = chosen.name if chosen is not None else None
        weights[name] = full_state_dict(module)
        return chosen

    chosen = phase("tuned", tuned(out))
    phase("fixed", ZeroStrategy(stage=chosen.stage))
    phase("cached", tuned(out))
    phase("retune", tuned(out, retune=True))
    phase("other", tuned(out), DeepRegressionModule())
    phase(
        "attention",
        tuned(out, tune_options=["zero2", "zero3"], tune_cache=out / "attention.json"),
        AttentionRegression(),
    )
    result["unknown_option"] = error_of(lambda: phase("bad", tuned(out, tune_options=["zero9"])))
    nothing = ZeroAutoStrategy(tune=True, tune_cache=out / "cache.json", host_memory=1000)
    result["nothing_fits"] = error_of(lambda: phase("bad", nothing))
    if torch.distributed.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(result, indent=1))
        for name, state in weights.items():
            torch.save(state, out / f"{name}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
