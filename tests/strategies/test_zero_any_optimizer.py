"""Optimizer offload with torch optimizers other than Adam/AdamW: SGD runs as it is on the offloaded fp32 weights,
Adagrad becomes DeepSpeed's CPU Adagrad, LBFGS is refused by name; results equal a single-process reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from _support.launch import REPO_ROOT, run_torchrun
from _support.models import make_net, make_regression_data, rank_batches

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_any_optimizer.py"
RUNS = [
    "sgd@zero2_offload",
    "sgd@zero3_offload",
    "adagrad@zero2_offload",
    "adagrad@zero3_offload",
    "lbfgs@zero3_offload",
]
STEPS = 6


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("any_optimizer")
    proc = run_torchrun(SCRIPT, 2, [out, ",".join(RUNS), "--steps", STEPS])
    return out, proc.stdout + proc.stderr


def reference(kind: str) -> dict[str, torch.Tensor]:
    """Plain single-process torch: the same optimizer and per-step scheduler on the same global batches."""
    import sys

    sys.path.insert(0, str(SCRIPT.parent))
    from zero_any_optimizer import make_optimizer, make_scheduler

    data = make_regression_data()
    net = make_net(0)
    optimizer = make_optimizer(kind, net.parameters())
    scheduler = make_scheduler(optimizer)
    for step in rank_batches(64, 2, 4, epoch=0)[:STEPS]:
        index = torch.tensor([i for rank_indices in step for i in rank_indices])
        optimizer.zero_grad()
        nn.functional.mse_loss(net(data.tensors[0][index]), data.tensors[1][index]).backward()
        optimizer.step()
        scheduler.step()
    return {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("run", [r for r in RUNS if not r.startswith("lbfgs")])
def test_offloaded_optimizer_matches_single_process(launched: tuple[Path, str], run: str) -> None:
    out, _ = launched
    kind = run.partition("@")[0]
    meta = json.loads((out / f"{run}.json").read_text())
    assert meta["global_step"] == STEPS
    assert meta["optimizer"] == {"sgd": "SGD", "adagrad": "DeepSpeedCPUAdagrad"}[kind]
    assert meta["force_ds_cpu_optimizer"] is False
    assert meta["lr"] == [pytest.approx(0.05 * 0.5**3)]  # StepLR(step_size=2) stepped every optimizer step
    weights = torch.load(out / f"{run}.pt")
    expected = reference(kind)
    assert set(weights) == set(expected)
    for key, value in expected.items():
        diff = (weights[key] - value).abs().max().item()
        assert diff <= 1e-5, f"{run} {key}: differs from the single-process reference by {diff:.3e}"
    assert (expected["net.0.weight"] - make_net(0).state_dict()["0.weight"]).abs().max() > 1e-3


def test_unfused_optimizer_is_logged_once_per_run(launched: tuple[Path, str]) -> None:
    _, output = launched
    unfused = (
        "Optimizer offload: `SGD` has no fused DeepSpeed CPU implementation with these settings; it runs unfused on "
        "the CPU on the offloaded fp32 weights"
    )
    assert output.count(unfused) == 2
    assert output.count("Optimizer offload: `Adagrad` runs as DeepSpeed's `DeepSpeedCPUAdagrad` (L2 weight decay)") == 2


def test_lbfgs_is_refused_with_what_to_use(launched: tuple[Path, str]) -> None:
    out, _ = launched
    for rank in (0, 1):
        message = (out / f"lbfgs@zero3_offload.error.rank{rank}.txt").read_text()
        assert message == (
            "UnsupportedOffloadOptimizerError: Optimizer offload cannot run `LBFGS`: `LBFGS` needs a closure that "
            "re-evaluates the loss at every step, and DeepSpeed steps the optimizer without one; its state (the "
            "curvature history) also spans all parameters of a group instead of being per-parameter tensors that "
            "ZeRO can partition. Use an optimizer without a closure (e.g. `torch.optim.AdamW`) or train LBFGS "
            "without ZeRO (e.g. `strategy='ddp'`)."
        )
