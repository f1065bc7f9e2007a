"""torch.compile under the Trainer's ZeRO strategies: a LightningModule compiled with ``torch.compile`` (which
Lightning refuses under DeepSpeed) and the ``compile``/``compile_kwargs`` arguments run through DeepSpeed's own
``engine.compile()`` and end where the uncompiled run ends (fp32, 2 CPU ranks, <= 1e-5); what DeepSpeed cannot compile
is one error before the first step."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401
from _support.launch import REPO_ROOT, run_torchrun
from _support.models import RegressionModule, make_regression_data
from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.compile import check_compile_supported, compile_request, request_from_dynamo_context
from lightspeed.strategies import ZeroStrategy

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_compile.py"
CASES = {  # case: (ZeRO stage, where the request came from, the kwargs engine.compile() got)
    "zero1-torch.compile": (1, "torch.compile(model)", {}),
    "stage0-compile_kwargs": (0, "ZeroStrategy(compile_kwargs=...)", {}),
    "zero2-compile=True": (2, "ZeroStrategy(compile=True)", {}),
    "zero3_offload-torch.compile": (3, "torch.compile(model)", {"dynamic": False}),
}
DEEPCOMPILE = {"compile": {"deepcompile": True}}


def deepcompile_on_cpu(source: str, stage: int) -> str:
    return (
        f'{source} with DeepCompile (`"compile": {{"deepcompile": true}}` in the DeepSpeed config) cannot run under '
        f"ZeRO stage {stage} on the CPU: DeepCompile's op is CUDA code. Remove `deepcompile` from the config "
        "(engine.compile() then compiles the model with torch.compile, which works at every ZeRO stage on the CPU), "
        "or train on accelerator='cuda'."
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zero_compile")
    run_torchrun(SCRIPT, 2, [out], timeout=600)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_runs_through_engine_compile_and_match_the_uncompiled_run(runs: Path, case: str) -> None:
    stage, source, engine_kwargs = CASES[case]
    meta = json.loads((runs / f"{case}.json").read_text())
    assert meta["stage"] == stage and meta["global_step"] == 3
    assert meta["source"] == source
    assert meta["engine_is_compiled"] is True  # DeepSpeed's engine.compile() ran ...
    assert meta["engine_module_is_the_module"] and meta["module_call_compiled"]  # ... on the LightningModule
    assert meta["engine_compile_kwargs"] == engine_kwargs  # torch.compile's arguments reached it
    assert meta["graphs_in_process"] > 0  # and dynamo compiled graphs
    assert meta["lightning_compile_undone"]  # Lightning's per-method compile of a torch.compile(model) is undone
    # ZeRO-3: the attention layer is a leaf module (gathered whole on entry), so the compiled forward can trace it
    assert meta["zero3_leaf_modules"] == (["net.attention"] if stage == 3 else [])
    assert meta["uncompiled_moved"] > 1e-3  # the runs trained
    weights = torch.load(runs / f"{case}.pt")
    for key, expected in weights["uncompiled"].items():
        diff = (weights["compiled"][key] - expected).abs().max().item()
        assert diff <= 1e-5, f"{case}: {key} differs from the uncompiled run by {diff:.3e}"


def test_validate_after_fit_reuses_the_compiled_engine(runs: Path) -> None:
    meta = json.loads((runs / "zero1-torch.compile.json").read_text())
    assert meta["validate_reused_the_compiled_engine"] is True
    assert 0 < meta["val_loss"] < 10


def test_deepcompile_on_the_cpu_is_refused_at_trainer_init() -> None:
    strategy = ZeroStrategy(stage=2, compile=True, config=DEEPCOMPILE)
    with pytest.raises(DeepSpeedConfigError) as raised:
        L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    assert str(raised.value) == deepcompile_on_cpu("ZeroStrategy(compile=True)", 2)


# torch.compile imports inductor, whose import of torch.utils.mkldnn uses torch's own deprecated torch.jit API
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning:torch.jit._script")
def test_a_compiled_model_with_deepcompile_on_the_cpu_is_refused_at_fit_before_any_process_starts() -> None:
    trainer = L.Trainer(strategy=ZeroStrategy(stage=3, config=DEEPCOMPILE), accelerator="cpu", devices=2, logger=False)
    with pytest.raises(DeepSpeedConfigError) as raised:
        trainer.fit(torch.compile(RegressionModule()), DataLoader(make_regression_data(8), batch_size=4))
    assert str(raised.value) == deepcompile_on_cpu("torch.compile(model)", 3)


def test_bad_compile_arguments() -> None:
    with pytest.raises(DeepSpeedConfigError, match=r"ZeroStrategy\(compile=True\): 'mod' is not an argument of "):
        ZeroStrategy(stage=2, compile=True, compile_kwargs={"mod": "max-autotune"})
    with pytest.raises(DeepSpeedConfigError, match=r"takes a dict of `torch.compile` arguments"):
        ZeroStrategy(stage=2, compile_kwargs="max-autotune")  # type: ignore[arg-type]
    # DeepCompile at stage 0 (the CUDA check; there is no GPU here)
    request = compile_request(True, None, "ZeroStrategy")
    assert request is not None
    with pytest.raises(DeepSpeedConfigError, match=r"under ZeRO stage 0 on CUDA: DeepCompile covers ZeRO stages 1-3"):
        check_compile_supported(request, {"zero_optimization": {"stage": 0}, **DEEPCOMPILE}, "cuda")
    check_compile_supported(request, {"zero_optimization": {"stage": 3}}, "cpu")  # the plain case passes


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning:torch.jit._script")
def test_the_arguments_of_a_compiled_lightning_module_are_read_back() -> None:
    from lightning.pytorch.utilities.compile import from_compiled

    compiled = torch.compile(RegressionModule(), fullgraph=True, dynamic=False, mode="max-autotune-no-cudagraphs")
    request = request_from_dynamo_context(from_compiled(compiled)._compiler_ctx["dynamo_ctx"])
    assert request.backend == "inductor"
    assert request.kwargs["fullgraph"] is True and request.kwargs["dynamic"] is False
    assert request.kwargs["options"]["max_autotune"] is True  # what the mode stands for
    eager = request_from_dynamo_context(
        from_compiled(torch.compile(RegressionModule(), backend="aot_eager"))._compiler_ctx["dynamo_ctx"]
    )
    assert (eager.backend, dict(eager.kwargs)) == ("aot_eager", {})
    assert eager.describe() == "engine.compile(backend='aot_eager', compile_kwargs={})"
