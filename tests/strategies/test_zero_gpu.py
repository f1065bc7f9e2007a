"""The ZeRO strategies under the Trainer on CUDA (nccl): every stage with and without offload, in fp32, bf16-mixed and
16-mixed (dynamic loss scaling), against one plain process. Marked `gpu`: skipped with the reason printed where no
GPU is visible (`scripts/gpu_check.sh` runs them on a GPU machine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _support.cuda_runs import PRECISIONS, PRESETS, RUNS, STEPS, check_saved_run, cuda_devices
from _support.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_train.py"
BATCH = 4

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zero_cuda")
    devices = cuda_devices()
    args = [out, ",".join(RUNS), "--steps", STEPS, "--devices", devices, "--batch", BATCH, "--accelerator", "cuda"]
    run_torchrun(SCRIPT, devices, args, timeout=600)
    return out


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", PRESETS)
def test_zero_on_cuda_matches_single_process(cuda_runs: Path, name: str, precision: str) -> None:
    meta = check_saved_run(cuda_runs, f"{name}@{precision}", precision, BATCH)
    assert meta["batches"] == STEPS


def test_cpu_accelerator_puts_nothing_on_the_gpu(tmp_path: Path) -> None:
    # a GPU is visible and DeepSpeed would pick it by itself: accelerator="cpu" must run DeepSpeed on its CPU
    # accelerator and allocate nothing on the GPU. (A CUDA context does appear: Lightning's Trainer.fit collects the
    # CUDA RNG states around its sanity check wherever a GPU is visible, whatever the accelerator; seen on an H200.)
    run_torchrun(SCRIPT, 2, [tmp_path, "zero3_offload", "--steps", 2, "--accelerator", "cpu"])
    meta = json.loads((tmp_path / "zero3_offload.json").read_text())
    assert meta["deepspeed_accelerator"] == "cpu" and meta["device"] == "cpu"
    assert meta["cuda_bytes"] == 0
