"""torch.compile under lightspeed's ZeRO strategies in Lightning Fabric: a model compiled with ``torch.compile``
before ``fabric.setup`` (which Fabric would re-apply around the whole DeepSpeed engine) and
``ZeroFabricStrategy(compile=True)`` run through DeepSpeed's own ``engine.compile()`` and end where the uncompiled
loop ends (fp32, 2 CPU ranks, <= 1e-5); what DeepSpeed cannot compile is one error before the first step."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

import lightspeed
from _support.launch import REPO_ROOT, run_torchrun
from lightspeed.core.errors import DeepSpeedConfigError

SCRIPT = REPO_ROOT / "tests" / "fabric" / "scripts" / "fabric_compile.py"
CASES = {  # case: (where the request came from, the kwargs engine.compile() got, ZeRO-3 leaf modules)
    "zero2-torch.compile": ("torch.compile(model)", {}, []),
    "stage3-compile=True": ("ZeroFabricStrategy(compile=True)", {}, ["attention"]),
    "zero1_offload-torch.compile": ("torch.compile(model)", {"dynamic": False}, []),
}


def deepcompile_on_cpu(source: str) -> str:
    return (
        f'{source} with DeepCompile (`"compile": {{"deepcompile": true}}` in the DeepSpeed config) cannot run under '
        "ZeRO stage 2 on the CPU: DeepCompile's op is CUDA code. Remove `deepcompile` from the config "
        "(engine.compile() then compiles the model with torch.compile, which works at every ZeRO stage on the CPU), "
        "or train on accelerator='cuda'."
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fabric_compile")
    run_torchrun(SCRIPT, 2, [out], timeout=600)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_loops_run_through_engine_compile_and_match_the_uncompiled_loop(runs: Path, case: str) -> None:
    source, engine_kwargs, leaf_modules = CASES[case]
    meta = json.loads((runs / f"{case}.json").read_text())
    assert meta["global_steps"] == 3
    assert meta["engine_is_compiled"] is True  # DeepSpeed's engine.compile() ran ...
    assert meta["engine_module_is_the_net"] and meta["net_call_compiled"]  # ... on the user's module
    assert meta["fabric_calls_the_engine"] is True  # and Fabric calls the engine, not torch.compile(engine)
    assert meta["source"] == source
    assert meta["request"] == f"engine.compile(backend='inductor', compile_kwargs={engine_kwargs!r})"
    assert meta["engine_compile_kwargs"] == engine_kwargs  # torch.compile's arguments reached it
    assert meta["graphs_in_process"] > 0
    # the hook that catches Fabric re-applying torch.compile is gone after the first step, compiled or not
    assert meta["registration_hooks_left"] == meta["uncompiled_registration_hooks_left"] == 0
    # ZeRO-3: the attention layer became a leaf module (gathered whole on entry) before the engine was built
    assert meta["zero3_leaf_modules"] == leaf_modules
    assert meta["uncompiled_moved"] > 1e-3  # the loops trained
    weights = torch.load(runs / f"{case}.pt")
    for key, expected in weights["uncompiled"].items():
        diff = (weights["compiled"][key] - expected).abs().max().item()
        assert diff <= 1e-5, f"{case}: {key} differs from the uncompiled loop by {diff:.3e}"


def test_a_compiled_model_with_deepcompile_on_the_cpu_is_refused_at_setup(runs: Path) -> None:
    refused = json.loads((runs / "deepcompile-refused.json").read_text())
    assert refused == {"raised": "DeepSpeedConfigError", "message": deepcompile_on_cpu("torch.compile(model)")}


def test_a_model_compiled_before_setup_with_attention_under_zero3_is_refused_at_setup(runs: Path) -> None:
    refused = json.loads((runs / "zero3-attention-refused.json").read_text())
    assert refused == {
        "raised": "DeepSpeedConfigError",
        "message": "torch.compile(model) under ZeRO stage 3: torch.nn.MultiheadAttention modules (attention) read "
        "a child's parameters without calling the child, which a compiled ZeRO-3 forward cannot gather. Such "
        "modules have to be ZeRO-3 leaf modules before the engine is built, and this compile request came after. "
        "Hand `fabric.setup` "
        "the model uncompiled, with `ZeroFabricStrategy(stage=3, ..., compile=True)` (lightspeed marks them before "
        "building the engine), or mark them yourself before `fabric.setup`: "
        "`deepspeed.utils.set_z3_leaf_modules(model, [torch.nn.MultiheadAttention])`.",
    }


def test_compile_arguments_fail_before_launch() -> None:
    strategy = lightspeed.fabric.ZeroFabricStrategy(stage=2, compile=True, config={"compile": {"deepcompile": True}})
    with pytest.raises(DeepSpeedConfigError) as raised:
        L.Fabric(strategy=strategy, accelerator="cpu", devices=2)
    assert str(raised.value) == deepcompile_on_cpu("ZeroFabricStrategy(compile=True)")
    with pytest.raises(DeepSpeedConfigError, match=r"ZeroAutoFabricStrategy\(compile=True\): 'mod' is not an"):
        lightspeed.fabric.ZeroAutoFabricStrategy(compile=True, compile_kwargs={"mod": "default"})
