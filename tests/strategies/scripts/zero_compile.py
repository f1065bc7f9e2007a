"""Worker: torch.compile under the Trainer's ZeRO strategies, compiled and uncompiled runs on the ranks of one launch.

usage: zero_compile.py OUT_DIR
For each case, RegressionModule trains 3 steps uncompiled and 3 steps compiled (fp32, batch 4); rank 0 writes
OUT_DIR/<case>.pt (both runs' gathered weights) and OUT_DIR/<case>.json (what the compiled engine reports).
Cases: zero1 with `torch.compile(model)` handed to `fit` (then `validate` on the same engine); stage 0 with
`compile_kwargs` alone; zero2 with `compile=True`; zero3_offload (parameters and optimizer on the CPU) with
`torch.compile(model, dynamic=False)` of a model with a `torch.nn.MultiheadAttention` (trained with SGD: Adam turns
the rounding noise of the attention's key bias, whose gradient is zero in exact arithmetic, into steps of lr).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from deepspeed.utils import z3_leaf_module
from torch import nn
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401  (registers the strategy names)
from _support.models import IN_FEATURES, OUT_FEATURES, RegressionModule, full_state_dict, make_regression_data
from _support.trainers import quiet_trainer
from lightspeed.strategies import ZeroStrategy

STEPS, BATCH = 3, 4


class AttentionNet(nn.Module):
    """Two tokens through a torch.nn.MultiheadAttention, which reads its out_proj's weight without calling out_proj."""

    def __init__(self) -> None:
        super().__init__()
        rng = torch.random.get_rng_state()
        torch.manual_seed(0)
        self.embed = nn.Linear(IN_FEATURES, 16)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(16, OUT_FEATURES)
        torch.random.set_rng_state(rng)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).view(x.shape[0], 2, 8)
        mixed, _ = self.attention(tokens, tokens, tokens, need_weights=False)
        return self.head(mixed.flatten(1))


class AttentionModule(RegressionModule):
    def __init__(self) -> None:
        super().__init__(lr=0.05, optimizer="sgd")
        self.net = AttentionNet()


# case -> (strategy of the uncompiled run, of the compiled run, `torch.compile` arguments of the model given to fit
# or None: the module itself)
CASES: dict[str, tuple[Any, Any, dict[str, Any] | None]] = {
    "zero1-torch.compile": (lambda: "zero1", lambda: "zero1", {}),
    "stage0-compile_kwargs": (
        lambda: ZeroStrategy(stage=0),
        lambda: ZeroStrategy(stage=0, compile_kwargs={"backend": "inductor"}),
        None,
    ),
    "zero2-compile=True": (lambda: "zero2", lambda: ZeroStrategy(stage=2, compile=True), None),
    "zero3_offload-torch.compile": (lambda: "zero3_offload", lambda: "zero3_offload", {"dynamic": False}),
}


def fit(case: str, strategy: Any, compile_model: dict[str, Any] | None) -> tuple[L.Trainer, RegressionModule, float]:
    L.seed_everything(0, verbose=False)
    module = AttentionModule() if case.startswith("zero3") else RegressionModule()
    model: Any = torch.compile(module, **compile_model) if compile_model is not None else module
    trainer = quiet_trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
    )
    start = time.perf_counter()
    trainer.fit(model, DataLoader(make_regression_data(), batch_size=BATCH))
    return trainer, module, time.perf_counter() - start


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for case, (plain_strategy, compiled_strategy, compile_model) in CASES.items():
        plain, _, plain_seconds = fit(case, plain_strategy(), None)
        plain_weights = full_state_dict(plain.strategy.deepspeed_engine.module)
        initial = (AttentionModule() if case.startswith("zero3") else RegressionModule()).state_dict()
        trainer, module, seconds = fit(case, compiled_strategy(), compile_model)
        engine = trainer.strategy.deepspeed_engine
        meta: dict[str, Any] = {
            "engine_is_compiled": engine.is_compiled,
            "engine_module_is_the_module": engine.module is module,
            "module_call_compiled": getattr(engine.module, "_compiled_call_impl", None) is not None,
            "lightning_compile_undone": module._compiler_ctx is None,
            # (graphs compiled by an earlier case are reused where dynamo's guards hold)
            "graphs_in_process": torch._dynamo.utils.counters["stats"]["unique_graphs"],
            "engine_compile_kwargs": dict(engine._compile_kwargs),
            "request": trainer.strategy.compile_request.describe(),
            "source": trainer.strategy.compile_request.source,
            "stage": trainer.strategy.config["zero_optimization"]["stage"],
            "global_step": trainer.global_step,
            "seconds": {"uncompiled": plain_seconds, "compiled": seconds},
            "uncompiled_moved": max((plain_weights[k] - v).abs().max().item() for k, v in initial.items()),
            "zero3_leaf_modules": [name for name, sub in module.named_modules() if z3_leaf_module(sub)],
        }
        if case.startswith("zero1"):
            results = trainer.validate(module, DataLoader(make_regression_data(16), batch_size=BATCH), verbose=False)
            meta["validate_reused_the_compiled_engine"] = trainer.strategy.deepspeed_engine is engine
            meta["val_loss"] = results[0]["val_loss"]
        weights = full_state_dict(engine.module)
        if trainer.is_global_zero:
            torch.save({"uncompiled": plain_weights, "compiled": weights}, out / f"{case}.pt")
            (out / f"{case}.json").write_text(json.dumps(meta))


if __name__ == "__main__":
    main()
