"""examples/slurm/train.py as `srun` starts it (one plain process per task, Lightning's SLURMEnvironment, no
launcher): one simulated node x 2 tasks on the CPU, with the strategy its docstring offers; it checkpoints and
exports."""

from __future__ import annotations

import sys
from pathlib import Path

from safetensors.torch import load_file

from _support.launch import REPO_ROOT, run_srun_tasks

SCRIPT = REPO_ROOT / "examples" / "slurm" / "train.py"


def test_the_slurm_example_trains_checkpoints_and_exports_under_srun(tmp_path: Path) -> None:
    args = ["--num-nodes", "1", "--devices", "2", "--accelerator", "cpu", "--strategy", "zero3_offload"]
    args += ["--epochs", "1", "--width", "16", "--samples", "256"]
    outputs = run_srun_tasks([sys.executable, str(SCRIPT), *args], nodes=1, tasks_per_node=2, cwd=tmp_path)
    assert "ZeRO-3, optimizer states on cpu, parameters on cpu" in outputs[0]
    assert (tmp_path / "checkpoints" / "last.ckpt").is_dir()
    weights = load_file(tmp_path / "export" / "model.safetensors")
    assert weights["net.0.weight"].shape == (64, 16)
