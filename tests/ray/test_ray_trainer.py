"""The Trainer under Ray Train with ``RayZeroStrategy``, exactly as Ray's Lightning guide builds it: 2 CPU workers,
a worker killed after the first epoch's checkpoint, ``FailureConfig(max_failures=1)`` restarting the workers from
``ray.train.get_checkpoint()``; the run ends equal to one plain process, every worker wrote only its own shard into
its own report directory, and the checkpoint in Ray's storage is complete and exports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray.train", reason="needs Ray Train: pip install 'lightspeed[ray]'")

from safetensors.torch import load_file  # noqa: E402

from _support.launch import REPO_ROOT, run_python  # noqa: E402
from _support.models import reference_training  # noqa: E402
from lightspeed.core.reliability import staging  # noqa: E402
from lightspeed.export import export_checkpoint  # noqa: E402

SCRIPT = REPO_ROOT / "tests" / "ray" / "scripts" / "ray_fit.py"
EPOCHS, STEPS_PER_EPOCH = 2, 8  # 64 samples, 2 workers x batch 4


# ZeRO-2 here; the Trainer under Ray with ZeRO-3: tests/examples/test_ray_train.py and docs/ray.md's snippet, and the
# killed worker under ZeRO-3: tests/ray/test_ray_fabric.py
@pytest.fixture(scope="module", params=[2], ids=["zero2"])
def killed_and_resumed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"ray_zero{request.param}")
    run_python(SCRIPT, [out, request.param, EPOCHS, "kill"], timeout=600)
    return out


def test_a_killed_worker_is_restarted_and_the_run_ends_equal_to_one_process(killed_and_resumed: Path) -> None:
    result = json.loads((killed_and_resumed / "result.json").read_text())
    assert result["resumed_from_step"] == STEPS_PER_EPOCH  # the restart began at the first epoch's checkpoint
    assert result["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert {"RayZeroStrategy", "ZeroStrategy", "RayDeepSpeedStrategy"} <= set(result["strategy_classes"])
    weights = torch.load(killed_and_resumed / "weights.pt")
    reference = reference_training(steps=EPOCHS * STEPS_PER_EPOCH, world_size=2, batch=4)
    assert sorted(weights) == sorted(reference)
    for key, expected in reference.items():
        assert (weights[key] - expected).abs().max().item() <= 1e-6, key


def test_every_worker_saves_only_its_own_shard_into_its_own_report_directory(killed_and_resumed: Path) -> None:
    saves = {
        rank: [json.loads(line) for line in (killed_and_resumed / f"saves_rank{rank}.jsonl").read_text().splitlines()]
        for rank in (0, 1)
    }
    assert [len(saves[rank]) for rank in (0, 1)] == [EPOCHS, EPOCHS]  # one save per epoch (attempt 1 resumed at 1)
    for first, second in zip(saves[0], saves[1], strict=True):
        assert first["path"] != second["path"]
        assert all("rank_1_" not in name for name in first["files"])
        assert second["files"] and all("zero_pp_rank_1_" in name for name in second["files"]), second["files"]
        assert staging.COMPLETE_MARKER in first["files"] and staging.COMPLETE_MARKER not in second["files"]


def test_the_checkpoint_in_rays_storage_is_complete_and_exports(killed_and_resumed: Path, tmp_path: Path) -> None:
    checkpoint = Path((killed_and_resumed / "ray_checkpoint.txt").read_text()) / "checkpoint.ckpt"
    staging.require_intact(checkpoint)  # rank 0's marker lists rank 1's files too, all present after Ray's merge
    listed = json.loads((checkpoint / staging.COMPLETE_MARKER).read_text())["files"]
    assert any("zero_pp_rank_1_" in name for name in listed)
    export_checkpoint(checkpoint, tmp_path / "export", max_shard_size=None)
    exported: dict[str, torch.Tensor] = {}
    for file in sorted((tmp_path / "export").glob("*.safetensors")):
        exported.update(load_file(file))
    weights = torch.load(killed_and_resumed / "weights.pt")
    assert sorted(exported) == sorted(weights)
    for key, value in weights.items():
        assert (exported[key] - value).abs().max().item() <= 1e-6, key
