"""Checkpoint directories appear complete or not at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightspeed.core.errors import IncompleteCheckpointError
from lightspeed.core.reliability import staging as atomic_dir


def _write(directory: Path, content: str) -> None:
    (directory / "rank_0.pt").write_text(content)


def test_commit_creates_complete_directory(tmp_path: Path) -> None:
    target = tmp_path / "epoch=1.ckpt"
    staging = atomic_dir.prepare_staging(target)
    assert not target.exists()
    _write(staging, "weights")
    atomic_dir.commit(target, {"global_step": 7})
    assert not staging.exists()
    atomic_dir.require_complete(target)
    assert json.loads((target / atomic_dir.COMPLETE_MARKER).read_text())["global_step"] == 7
    assert (target / "rank_0.pt").read_text() == "weights"


def test_commit_replaces_an_existing_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    _write(atomic_dir.prepare_staging(target), "old")
    atomic_dir.commit(target)
    _write(atomic_dir.prepare_staging(target), "new")
    assert (target / "rank_0.pt").read_text() == "old"  # untouched until the new one is committed
    atomic_dir.commit(target)
    assert (target / "rank_0.pt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_interrupted_save_is_detected_and_cleaned_up(tmp_path: Path) -> None:
    target = tmp_path / "model.ckpt"
    _write(atomic_dir.prepare_staging(target), "partial")
    with pytest.raises(IncompleteCheckpointError, match="not written completely"):
        atomic_dir.require_complete(atomic_dir.staging_path(target))
    staging = atomic_dir.prepare_staging(target)  # the next save starts clean
    assert list(staging.iterdir()) == []


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(IncompleteCheckpointError, match="is not a directory"):
        atomic_dir.require_complete(tmp_path / "missing")


def test_failed_swap_puts_the_previous_checkpoint_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    target = tmp_path / "last.ckpt"
    _write(atomic_dir.prepare_staging(target), "old")
    atomic_dir.commit(target)
    _write(atomic_dir.prepare_staging(target), "new")
    real_replace = os.replace

    def failing_second_rename(src, dst):
        if Path(src) == atomic_dir.staging_path(target):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(atomic_dir.os, "replace", failing_second_rename)
    with pytest.raises(OSError, match="No space left"):
        atomic_dir.commit(target)
    monkeypatch.undo()
    atomic_dir.require_complete(target)
    assert (target / "rank_0.pt").read_text() == "old"
    assert not atomic_dir.replaced_path(target).exists()


def test_target_lost_mid_swap_points_to_the_previous_copy(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    _write(atomic_dir.prepare_staging(target), "old")
    atomic_dir.commit(target)
    target.rename(atomic_dir.replaced_path(target))  # as if killed between the two renames
    with pytest.raises(IncompleteCheckpointError, match=r"holds the previous version .* Rename it back"):
        atomic_dir.require_complete(target)


def test_stale_staging_directories_are_swept(tmp_path: Path) -> None:
    crashed = atomic_dir.prepare_staging(tmp_path / "epoch=3.ckpt")
    current = atomic_dir.prepare_staging(tmp_path / "epoch=4.ckpt")
    (tmp_path / "keep.lightspeed-staging.txt").write_text("a file, not a staging directory")
    removed = atomic_dir.remove_stale_staging(tmp_path, keep=current)
    assert removed == [crashed]
    assert current.is_dir() and not crashed.exists()


def test_commit_records_file_sizes_and_a_truncated_file_is_reported(tmp_path: Path) -> None:
    target = tmp_path / "model.ckpt"
    staging = atomic_dir.prepare_staging(target)
    (staging / "tag").mkdir()
    (staging / "tag" / "shard_0.pt").write_bytes(b"x" * 100)
    (staging / "tag" / "shard_1.pt").write_bytes(b"y" * 50)
    atomic_dir.commit(target)
    assert json.loads((target / atomic_dir.COMPLETE_MARKER).read_text())["files"] == {
        "tag/shard_0.pt": 100,
        "tag/shard_1.pt": 50,
    }
    atomic_dir.require_intact(target)
    with (target / "tag" / "shard_0.pt").open("r+b") as f:
        f.truncate(40)
    (target / "tag" / "shard_1.pt").unlink()
    assert atomic_dir.damaged_files(target) == [
        "tag/shard_0.pt (40 bytes, 100 when written)",
        "tag/shard_1.pt (missing)",
    ]
    with pytest.raises(IncompleteCheckpointError) as error:
        atomic_dir.require_intact(target)
    assert str(error.value) == (
        f"Checkpoint {str(target)!r} is damaged: tag/shard_0.pt (40 bytes, 100 when written), tag/shard_1.pt "
        "(missing). It changed after it was written (a truncated copy, a full disk while copying, or a file "
        "replaced). Resume from an earlier checkpoint."
    )


def test_a_marker_without_sizes_reads_as_intact(tmp_path: Path) -> None:
    target = tmp_path / "old.ckpt"
    target.mkdir()
    (target / atomic_dir.COMPLETE_MARKER).write_text(json.dumps({"complete": True}))
    assert atomic_dir.damaged_files(target) == []


def test_a_single_file_checkpoint_is_renamed_into_place_once_written(tmp_path: Path) -> None:
    target = tmp_path / "step=3.ckpt"
    target.write_text("previous")
    seen_during_write: list[bool] = []

    def write(staging: Path) -> None:
        seen_during_write.append(target.read_text() == "previous")  # the old file is untouched while writing
        staging.write_text("new")

    assert atomic_dir.save_file_atomically(target, write, writer=True) == target
    assert target.read_text() == "new" and seen_during_write == [True]
    assert not atomic_dir.staging_path(target).exists()


def test_a_failed_single_file_save_leaves_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "step=3.ckpt"
    target.write_text("previous")

    def write(staging: Path) -> None:
        staging.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left on device"):
        atomic_dir.save_file_atomically(target, write, writer=True)
    assert target.read_text() == "previous"


def test_a_rank_that_does_not_write_leaves_the_file_alone(tmp_path: Path) -> None:
    target = tmp_path / "step=3.ckpt"
    atomic_dir.save_file_atomically(target, lambda staging: staging.write_text("x"), writer=False)
    assert not target.exists()


def test_a_folder_inside_a_checkpoint_names_the_checkpoint_to_load(tmp_path: Path) -> None:
    from lightspeed.errors import CheckpointError

    target = tmp_path / "last.ckpt"
    staging = atomic_dir.prepare_staging(target)
    (staging / "checkpoint").mkdir()
    _write(staging / "checkpoint", "weights")
    atomic_dir.commit(target)
    with pytest.raises(CheckpointError) as info:
        atomic_dir.require_complete(target / "checkpoint")
    assert str(info.value) == (
        f"{str(target / 'checkpoint')!r} is a folder inside the checkpoint {str(target)!r}, not a checkpoint of its "
        f"own: load the checkpoint directory itself, {str(target)!r}."
    )
    atomic_dir.require_complete(target)  # the checkpoint itself is fine
