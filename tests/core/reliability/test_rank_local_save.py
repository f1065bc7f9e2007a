"""Checkpoints whose ranks each save into a directory of their own (Ray Train's report directories, merged by Ray
into one): every rank commits its own files, rank 0's completion marker lists all of them, so the merged directories
are one intact checkpoint; two ranks writing one name, or ranks that half share a path, are errors on every rank."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from _support.launch import REPO_ROOT, run_torchrun
from lightspeed.core.reliability import staging

SCRIPT = REPO_ROOT / "tests" / "core" / "reliability" / "scripts" / "rank_local_save.py"


@pytest.fixture(scope="module")
def facts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("rank_local")
    run_torchrun(SCRIPT, 3, [out], timeout=300)
    return out, [json.loads((out / f"facts_rank{rank}.json").read_text()) for rank in range(3)]


def test_every_rank_keeps_only_its_own_files_and_rank_0_the_marker(facts: tuple[Path, list[dict]]) -> None:
    _, by_rank = facts
    assert [rank_facts["own"] for rank_facts in by_rank] == [
        ["config.txt", staging.COMPLETE_MARKER, "shard_0.bin"],
        ["shard_1.bin"],
        ["shard_2.bin"],
    ]


def test_the_merged_directories_are_one_intact_checkpoint_and_a_missing_shard_is_named(
    facts: tuple[Path, list[dict]], tmp_path: Path
) -> None:
    out, _ = facts
    merged = tmp_path / "merged"
    for rank in range(3):
        shutil.copytree(out / f"rank{rank}" / "ckpt", merged, dirs_exist_ok=True)
    staging.require_intact(merged)
    (merged / "shard_2.bin").unlink()
    assert staging.damaged_files(merged) == ["shard_2.bin (missing)"]


def test_two_ranks_writing_one_name_is_an_error_on_every_rank(facts: tuple[Path, list[dict]]) -> None:
    _, by_rank = facts
    expected = (
        f"CheckpointError: Saving checkpoint '{facts[0]}/rank{{rank}}/clash': rank 1 wrote 'same.bin', which an "
        "earlier rank wrote too; merged into one checkpoint, one would replace the other. Give every rank its own "
        "checkpoint path only where each writes its own files (lightspeed's Ray strategy does)."
    )
    assert [rank_facts["clash"] for rank_facts in by_rank] == [expected.format(rank=rank) for rank in range(3)]


def test_one_path_on_every_rank_saves_as_usual_and_a_half_shared_one_is_an_error(
    facts: tuple[Path, list[dict]],
) -> None:
    out, by_rank = facts
    assert [rank_facts["shared"] for rank_facts in by_rank] == [False, False, False]
    expected = (
        f"CheckpointError: The ranks asked to save checkpoints to ['{out}/ab', '{out}/c']: some ranks share a path "
        "and some do not. Pass the same path on every rank, or a different path on each rank (one directory per "
        "worker, as Ray Train's report directories are)."
    )
    assert [rank_facts["mixed"] for rank_facts in by_rank] == [expected] * 3
