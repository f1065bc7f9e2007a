"""Numerical truth: 2 CPU ranks under every ZeRO stage (with and without offload) end with the same weights as a
plain single-process PyTorch loop on the same global batches (fp32, max abs difference <= 1e-5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _support.launch import REPO_ROOT, run_python, run_torchrun
from _support.models import reference_training

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_train.py"
STEPS, DEVICES, BATCH = 4, 2, 4
TORCHRUN_NAMES = ["zero1", "zero1_offload", "zero2", "zero2_offload", "zero3", "zero3_nvme"]
LIGHTNING_LAUNCHER_NAMES = ["zero3_offload"]


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return reference_training(steps=STEPS, world_size=DEVICES, batch=BATCH)


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("zero_torchrun")
    nvme = {"LIGHTSPEED_NVME_PATH": str(out / "nvme")}  # zero3_nvme swaps into a temporary directory
    proc = run_torchrun(SCRIPT, DEVICES, [out, ",".join(TORCHRUN_NAMES), "--steps", STEPS, "--batch", BATCH], env=nvme)
    return out, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def torchrun_results(torchrun_run) -> Path:
    return torchrun_run[0]


@pytest.fixture(scope="module")
def lightning_launcher_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zero_lightning_launcher")
    # a plain `python script.py`: the Trainer (devices=2) starts the second rank with Lightning's own launcher
    run_python(SCRIPT, [out, ",".join(LIGHTNING_LAUNCHER_NAMES), "--steps", STEPS, "--batch", BATCH])
    return out


def _assert_matches(out: Path, name: str, reference: dict[str, torch.Tensor]) -> dict:
    weights = torch.load(out / f"{name}.pt")
    meta = json.loads((out / f"{name}.json").read_text())
    assert meta["world_size"] == DEVICES
    assert meta["global_step"] == STEPS
    assert sorted(weights) == sorted(reference)
    for key, expected in reference.items():
        diff = (weights[key] - expected).abs().max().item()
        assert diff <= 1e-5, f"{name}: {key} differs from the single-process reference by {diff:.3e}"
    # the run really trained (the reference moved away from the initial weights)
    from _support.models import make_net

    initial = make_net().state_dict()
    assert (weights["net.0.weight"] - initial["0.weight"]).abs().max() > 1e-3
    return meta


@pytest.mark.parametrize("name", TORCHRUN_NAMES)
def test_zero_matches_single_process_under_torchrun(torchrun_results: Path, reference, name: str) -> None:
    meta = _assert_matches(torchrun_results, name, reference)
    stage = int(name[4])
    assert meta["config"]["zero_optimization"]["stage"] == stage
    assert meta["config"]["train_micro_batch_size_per_gpu"] == BATCH
    offloaded = "offload" in name or "nvme" in name
    assert meta["optimizer"] == ("DeepSpeedCPUAdam" if offloaded else "AdamW")


def test_nvme_offload_swapped_into_the_given_directory(torchrun_results: Path) -> None:
    meta = json.loads((torchrun_results / "zero3_nvme.json").read_text())
    zero = meta["config"]["zero_optimization"]
    assert zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "nvme"
    swap_root = torchrun_results / "nvme" / "zero_stage_3"
    for kind in ("optimizer", "float32params"):  # DeepSpeed's swap folders, one per rank
        assert sorted(p.name for p in (swap_root / kind).iterdir()) == ["rank0", "rank1"]


def test_resolved_config_and_optimizer_conversion_are_logged_once_per_run(torchrun_run) -> None:
    _, output = torchrun_run
    assert output.count("lightspeed: DeepSpeed config: ZeRO-") == len(TORCHRUN_NAMES)
    assert '"zero_optimization"' not in output  # the whole config only at DEBUG (LIGHTSPEED_LOG_LEVEL)
    offloaded = [n for n in TORCHRUN_NAMES if "offload" in n or "nvme" in n]
    assert output.count("runs as DeepSpeed's `DeepSpeedCPUAdam`") == len(offloaded)


@pytest.mark.parametrize("name", LIGHTNING_LAUNCHER_NAMES)
def test_zero_matches_single_process_under_lightning_launcher(lightning_launcher_results: Path, reference, name):
    meta = _assert_matches(lightning_launcher_results, name, reference)
    offload = meta["config"]["zero_optimization"]
    assert offload["offload_optimizer"]["device"] == "cpu"
    assert offload["offload_param"]["device"] == "cpu"
    assert meta["optimizer"] == "DeepSpeedCPUAdam"


BF16_RUNS = ["zero2@bf16-mixed", "zero3@bf16-true"]


@pytest.fixture(scope="module")
def bf16_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zero_bf16")
    run_torchrun(SCRIPT, DEVICES, [out, ",".join(BF16_RUNS), "--steps", STEPS, "--batch", BATCH])
    return out


@pytest.mark.parametrize("run", BF16_RUNS)
def test_bf16_on_cpu_becomes_deepspeed_bf16(bf16_results: Path, reference, run: str) -> None:
    meta = json.loads((bf16_results / f"{run}.json").read_text())
    assert meta["config"]["bf16"]["enabled"] is True
    assert meta["config"]["fp16"]["enabled"] is False
    assert meta["param_dtypes"] == ["torch.bfloat16"]  # DeepSpeed trains bf16 weights with fp32 master copies
    weights = torch.load(bf16_results / f"{run}.pt")
    for key, expected in reference.items():
        # bf16 keeps 8 bits of mantissa: weights of magnitude < 1 round to within ~4e-3 at each step
        diff = (weights[key] - expected).abs().max().item()
        assert diff <= 3e-2, f"{run}: {key} differs from the fp32 reference by {diff:.3e}"
