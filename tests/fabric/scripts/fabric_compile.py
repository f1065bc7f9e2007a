"""Worker: torch.compile under lightspeed's ZeRO strategies in Lightning Fabric loops, on the ranks of one launch.

usage: fabric_compile.py OUT_DIR
For each case the same 3-step AdamW loop (fp32, batch 4) runs uncompiled and compiled; rank 0 writes
OUT_DIR/<case>.pt (both runs' gathered weights) and OUT_DIR/<case>.json (what the compiled engine reports).
Cases: zero2 with `torch.compile(model)` handed to `fabric.setup` (Fabric would compile the whole engine);
stage 3 with `ZeroFabricStrategy(compile=True)` and a model with a `torch.nn.MultiheadAttention` built under
`fabric.init_module()` (SGD: see zero_compile.py in tests/strategies/scripts); zero1_offload with
`torch.compile(model, dynamic=False)`. Then two refusals (OUT_DIR/<refusal>.json holds the message):
`torch.compile(model)` under a DeepSpeed config asking for DeepCompile, which cannot run on the CPU; and
`torch.compile(model)` of the attention model under zero3, whose attention layer had to be a ZeRO-3 leaf module
before the engine was built.
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
from torch.nn.modules.module import _global_module_registration_hooks
from torch.utils.data import DataLoader

import lightspeed
from _support.models import IN_FEATURES, OUT_FEATURES, full_state_dict, make_net, make_regression_data

STEPS, BATCH = 3, 4
DEEPCOMPILE = {"compile": {"deepcompile": True}}


class AttentionNet(nn.Module):
    """Two tokens through a torch.nn.MultiheadAttention, which reads its out_proj's weight without calling out_proj."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(IN_FEATURES, 16)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(16, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).view(x.shape[0], 2, 8)
        mixed, _ = self.attention(tokens, tokens, tokens, need_weights=False)
        return self.head(mixed.flatten(1))


def train(strategy: Any, compile_model: dict[str, Any] | None, sharded: bool) -> dict[str, Any]:
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    torch.manual_seed(0)
    if sharded:  # the attention model, ZeRO-3 partitions built under init_module
        with fabric.init_module():
            net: nn.Module = AttentionNet()
        optimizer: torch.optim.Optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    else:
        net = make_net()
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    initial = full_state_dict(net)
    model: Any = torch.compile(net, **compile_model) if compile_model is not None else net
    start = time.perf_counter()
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(make_regression_data(), batch_size=BATCH, shuffle=True))
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    engine = fabric.strategy.model
    request = fabric.strategy.compile_request
    return {
        "fabric": fabric,
        "weights": full_state_dict(engine.module),
        "seconds": time.perf_counter() - start,
        "engine_is_compiled": engine.is_compiled,
        "fabric_calls_the_engine": model._forward_module is engine,  # not an OptimizedModule around it
        "engine_module_is_the_net": engine.module is net,
        "net_call_compiled": getattr(net, "_compiled_call_impl", None) is not None,
        "engine_compile_kwargs": dict(getattr(engine, "_compile_kwargs", {})),
        "request": request.describe() if request is not None else None,
        "source": request.source if request is not None else None,
        "global_steps": int(engine.global_steps),
        "registration_hooks_left": len(_global_module_registration_hooks),
        "zero3_leaf_modules": [name for name, sub in net.named_modules() if z3_leaf_module(sub)],
        "moved": max((v - full_state_dict(engine.module)[k]).abs().max().item() for k, v in initial.items()),
    }


CASES: dict[str, tuple[Any, Any, dict[str, Any] | None, bool]] = {
    # case: (uncompiled strategy, compiled strategy, torch.compile arguments or None, build under init_module)
    "zero2-torch.compile": (lambda: "zero2", lambda: "zero2", {}, False),
    "stage3-compile=True": (
        lambda: lightspeed.fabric.ZeroFabricStrategy(stage=3),
        lambda: lightspeed.fabric.ZeroFabricStrategy(stage=3, compile=True),
        None,
        True,
    ),
    "zero1_offload-torch.compile": (lambda: "zero1_offload", lambda: "zero1_offload", {"dynamic": False}, False),
}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for case, (plain_strategy, compiled_strategy, compile_model, sharded) in CASES.items():
        plain = train(plain_strategy(), None, sharded)
        compiled = train(compiled_strategy(), compile_model, sharded)
        # (graphs compiled by an earlier case are reused where dynamo's guards hold)
        compiled["graphs_in_process"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        compiled["seconds"] = {"uncompiled": plain["seconds"], "compiled": compiled["seconds"]}
        compiled["uncompiled_registration_hooks_left"] = plain["registration_hooks_left"]
        compiled["uncompiled_moved"] = plain["moved"]
        fabric = compiled.pop("fabric")
        plain.pop("fabric")
        weights = {"uncompiled": plain.pop("weights"), "compiled": compiled.pop("weights")}
        if fabric.global_rank == 0:
            torch.save(weights, out / f"{case}.pt")
            (out / f"{case}.json").write_text(json.dumps(compiled))

    refusals = {
        "deepcompile-refused": (lambda: lightspeed.fabric.ZeroFabricStrategy(stage=2, config=DEEPCOMPILE), make_net),
        "zero3-attention-refused": (lambda: "zero3", AttentionNet),
    }
    for refusal, (strategy, build) in refusals.items():
        fabric = L.Fabric(strategy=strategy(), accelerator="cpu", devices=2)
        fabric.launch()
        net = build()
        try:
            fabric.setup(torch.compile(net), torch.optim.SGD(net.parameters(), lr=1e-2))
            refused: dict[str, Any] = {"raised": None}
        except Exception as err:
            refused = {"raised": type(err).__name__, "message": str(err)}
        if fabric.global_rank == 0:
            (out / f"{refusal}.json").write_text(json.dumps(refused))


if __name__ == "__main__":
    main()
