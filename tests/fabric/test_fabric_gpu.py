"""lightspeed's ZeRO strategies under Lightning Fabric on CUDA (nccl): every stage with and without offload, in fp32,
bf16-mixed and 16-mixed (dynamic loss scaling), against one plain process. Marked `gpu`: skipped with the reason
printed where no GPU is visible (`scripts/gpu_check.sh` runs them on a GPU machine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from _support.cuda_runs import PRECISIONS, PRESETS, RUNS, STEPS, check_saved_run, cuda_devices
from _support.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "fabric" / "scripts" / "fabric_cases.py"
BATCH = 4  # what fabric_cases.py's train scenario uses

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fabric_cuda")
    specs = ",".join(f"train:{run}" for run in RUNS)
    args = [out, specs, "--accelerator", "cuda", "--devices", cuda_devices(), "--train-steps", STEPS]
    run_torchrun(SCRIPT, cuda_devices(), args, timeout=600)
    return out


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", PRESETS)
def test_fabric_zero_on_cuda_matches_single_process(cuda_runs: Path, name: str, precision: str) -> None:
    # the worker saves the weights without the "net." of the reference's keys, and the weights the model was built
    # with: under init_module() on a GPU (ZeRO-3) they come from the CUDA generator
    check_saved_run(cuda_runs, f"train_{name}@{precision}", precision, BATCH, key_prefix="net.")
