"""The ZeRO strategies on CUDA (nccl). Marked `gpu`: skipped with the reason printed where no GPU is visible."""

from __future__ import annotations

import json

import pytest
import torch

from _support.launch import REPO_ROOT, run_torchrun
from _support.models import reference_training

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_train.py"
NAMES = ["zero1", "zero2", "zero3", "zero3_offload"]

pytestmark = pytest.mark.gpu


def _devices() -> int:
    return max(1, min(2, torch.cuda.device_count()))


def test_zero_on_cuda_matches_single_process_fp32(tmp_path) -> None:
    devices = _devices()
    run_torchrun(
        SCRIPT, devices, [tmp_path, ",".join(NAMES), "--steps", 4, "--devices", devices, "--accelerator", "cuda"]
    )
    reference = reference_training(steps=4, world_size=devices, batch=4)
    for name in NAMES:
        weights = torch.load(tmp_path / f"{name}.pt")
        for key, expected in reference.items():
            # TF32 matmuls are off by default for fp32 in torch; cuBLAS reductions may still differ in order
            assert (weights[key] - expected).abs().max().item() <= 1e-4, (name, key)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_half_precision_trains_on_cuda(tmp_path, precision) -> None:
    devices = _devices()
    run_torchrun(
        SCRIPT,
        devices,
        [tmp_path, "zero2", "--steps", 4, "--devices", devices, "--accelerator", "cuda", "--precision", precision],
    )
    meta = json.loads((tmp_path / "zero2.json").read_text())
    key = "fp16" if precision == "16-mixed" else "bf16"
    assert meta["config"][key]["enabled"] is True
    reference = reference_training(steps=4, world_size=devices, batch=4)
    weights = torch.load(tmp_path / "zero2.pt")
    assert (weights["net.0.weight"] - reference["net.0.weight"]).abs().max().item() <= 5e-2


def test_cpu_accelerator_never_initialises_cuda_on_a_gpu_machine(tmp_path) -> None:
    # a GPU is visible, DeepSpeed would pick it by itself; accelerator="cpu" must keep every rank off CUDA
    run_torchrun(SCRIPT, 2, [tmp_path, "zero3_offload", "--steps", 2, "--accelerator", "cpu"])
    meta = json.loads((tmp_path / "zero3_offload.json").read_text())
    assert meta["cuda_initialized"] is False
