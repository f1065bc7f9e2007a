"""Checkpoint directories appear complete or not at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightspeed.core import atomic_dir


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
    with pytest.raises(atomic_dir.IncompleteCheckpointError, match="not written completely"):
        atomic_dir.require_complete(atomic_dir.staging_path(target))
    staging = atomic_dir.prepare_staging(target)  # the next save starts clean
    assert list(staging.iterdir()) == []


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(atomic_dir.IncompleteCheckpointError, match="is not a directory"):
        atomic_dir.require_complete(tmp_path / "missing")
