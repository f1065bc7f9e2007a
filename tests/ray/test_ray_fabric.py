"""A Fabric loop under Ray Train with ``RayZeroFabricStrategy`` (2 CPU workers, no ``devices``/``num_nodes``): each
worker ``fabric.save``s into its own directory and reports it; a worker killed after the step-4 checkpoint, Ray
restarts both, ``fabric.load`` of ``ray.train.get_checkpoint()`` resumes, and the run ends equal to one plain
process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray.train", reason="needs Ray Train: pip install 'lightspeed[ray]'")

from _support.launch import REPO_ROOT, run_python  # noqa: E402
from _support.models import reference_training  # noqa: E402
from lightspeed.core.reliability import staging  # noqa: E402

SCRIPT = REPO_ROOT / "tests" / "ray" / "scripts" / "ray_fabric.py"
STEPS = 12


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ray_fabric")
    run_python(SCRIPT, [out, 3, STEPS, "kill"], timeout=600)
    return out


def test_a_killed_worker_is_restarted_and_the_fabric_loop_ends_equal_to_one_process(killed_and_resumed: Path) -> None:
    assert json.loads((killed_and_resumed / "result.json").read_text()) == {"step": STEPS, "resumed_from_step": 4}
    weights = torch.load(killed_and_resumed / "weights.pt")
    reference = reference_training(steps=STEPS, world_size=2, batch=4)
    assert sorted(weights) == sorted(reference)
    for key, expected in reference.items():
        assert (weights[key] - expected).abs().max().item() <= 1e-6, key


def test_each_worker_saves_only_its_own_shard_and_rays_checkpoint_is_complete(killed_and_resumed: Path) -> None:
    saves = [
        [json.loads(line) for line in (killed_and_resumed / f"saves_rank{rank}.jsonl").read_text().splitlines()]
        for rank in (0, 1)
    ]
    assert [[save["step"] for save in by_rank] for by_rank in saves] == [[4, 8, 12], [4, 8, 12]]
    for save in saves[1]:
        assert save["files"] and all("zero_pp_rank_1_" in name for name in save["files"]), save["files"]
    for save in saves[0]:
        assert all("rank_1_" not in name for name in save["files"])
    checkpoint = Path((killed_and_resumed / "ray_checkpoint.txt").read_text()) / "state.ckpt"
    staging.require_intact(checkpoint)
    listed = json.loads((checkpoint / staging.COMPLETE_MARKER).read_text())
    assert listed["global_step"] == STEPS and any("zero_pp_rank_1_" in name for name in listed["files"])
