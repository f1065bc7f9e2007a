"""SLURM: four plain processes started with the environment ``srun`` gives its tasks (2 nodes x 2 tasks) train
through Lightning's SLURMEnvironment with a lightspeed strategy, and end with the weights of the same run under
torchrun."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from _support.launch import REPO_ROOT, run_srun_tasks, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "multinode.py"


def test_srun_tasks_train_through_lightnings_slurm_environment(tmp_path: Path) -> None:
    run_srun_tasks([sys.executable, str(SCRIPT), "slurm", str(tmp_path / "slurm"), "2"], nodes=2, tasks_per_node=2)
    for rank in range(4):
        facts = json.loads((tmp_path / "slurm" / f"slurm_rank{rank}.json").read_text())
        assert facts == {
            "environment": "SLURMEnvironment",
            "world_size": 4,
            "node_rank": rank // 2,
            "local_rank": rank % 2,
            "global_step": 4,
        }
    run_torchrun(SCRIPT, 4, ["slurm", tmp_path / "torchrun", "1"])
    slurm = torch.load(tmp_path / "slurm" / "weights_slurm.pt")["zero3_offload"]
    torchrun = torch.load(tmp_path / "torchrun" / "weights_slurm.pt")["zero3_offload"]
    assert json.loads((tmp_path / "torchrun" / "slurm_rank0.json").read_text())["environment"] == (
        "TorchElasticEnvironment"
    )
    for key, expected in torchrun.items():
        diff = (slurm[key] - expected).abs().max().item()
        assert diff <= 1e-6, f"{key}: the SLURM run differs from the torchrun run by {diff:.3e}"
