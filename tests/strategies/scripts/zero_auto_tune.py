"""Worker: zero_auto's measured mode on the ranks of one launch (``ZeroAutoStrategy(tune=True)``).

usage: zero_auto_tune.py OUT_DIR
Phases, each a fit of 4 steps on shuffled data (seed 0) with the tuning cache OUT_DIR/cache.json:
  tuned      trials of zero1, zero2, zero3; the chosen option trains
  fixed      the chosen option as a fixed ZeroStrategy, untuned (the tuned run must equal it bit for bit)
  cached     tuned again: the decision comes from the cache, no trials
  retune     retune=True: trials again
  other      another model shape with the same cache: its decision is not reused
  attention  a model with nn.MultiheadAttention (which reads out_proj.weight outside its module): zero3 is measured
  micro      zero2 with tune_micro_batches=[2, 8] on batch_size=4 x accumulate_grad_batches=2: three micro-batch
             sizes measured; the decision is forced to micro-batches of 8 (the rule is tested elsewhere), which
             re-batches the DataLoader and sets accumulate_grad_batches=1
  micro_fixed  zero2 untuned with batch_size=8 and accumulate_grad_batches=1 (micro must equal it bit for bit)
  bad        tune_options naming an unknown option; nothing fits; tune_micro_batches beside a
             GradientAccumulationScheduler
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
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch import nn
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401  (registers the strategy names)
from _support.models import IN_FEATURES, OUT_FEATURES, RegressionModule, full_state_dict, make_regression_data
from _support.trainers import quiet_trainer
from lightspeed.core.zero.tuner import decision
from lightspeed.core.zero.tuner.decision import pick_fastest
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


def fit(
    strategy: Any, module: L.LightningModule, batch_size: int = 4, accumulate: int = 1, callbacks: Any = ()
) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    trainer = quiet_trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=4,
        accumulate_grad_batches=accumulate,
        callbacks=list(callbacks),
    )
    trainer.fit(module, DataLoader(make_regression_data(), batch_size=batch_size, shuffle=True))
    return trainer


def forced_to_micro_batches_of(size: int) -> Any:
    """The tuner's pick replaced by the candidate with micro-batches of ``size``, whatever was measured."""

    def pick(trials: Any) -> Any:
        return next(trial for trial in trials if trial.candidate.micro_batch == size)

    return pick


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

    def phase(name: str, strategy: Any, module: L.LightningModule | None = None, **batching: Any) -> Any:
        capture.messages.clear()
        module = module or RegressionModule()
        trainer = fit(strategy, module, **batching)
        result.setdefault("batching", {})[name] = [trainer.train_dataloader.batch_size, trainer.accumulate_grad_batches]
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
    decision.pick_fastest = forced_to_micro_batches_of(8)
    micro = tuned(out, tune_options=["zero2"], tune_micro_batches=[2, 8], tune_cache=out / "micro.json")
    phase("micro", micro, batch_size=4, accumulate=2)
    decision.pick_fastest = pick_fastest
    phase("micro_fixed", ZeroStrategy(stage=2), batch_size=8, accumulate=1)
    scheduler = GradientAccumulationScheduler({0: 2})
    with_scheduler = tuned(out, tune_micro_batches=[2])
    result["accumulation_scheduler"] = error_of(lambda: phase("bad", with_scheduler, callbacks=[scheduler]))
    result["unknown_option"] = error_of(lambda: phase("bad", tuned(out, tune_options=["zero9"])))
    nothing = ZeroAutoStrategy(tune=True, tune_cache=out / "cache.json", host_memory=1000)
    result["nothing_fits"] = error_of(lambda: phase("bad", nothing))
    if torch.distributed.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(result, indent=1))
        for name, state in weights.items():
            torch.save(state, out / f"{name}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
