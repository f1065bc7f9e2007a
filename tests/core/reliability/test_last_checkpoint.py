"""The newest complete checkpoint in a directory (what a Fabric loop resumes from), and what it skips."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lightspeed.core.reliability import staging
from lightspeed.core.reliability.last_checkpoint import (
    describe_skipped,
    incomplete_checkpoints,
    newest_complete_checkpoint,
)


def _commit(target: Path, committed_at: float) -> None:
    staging.prepare_staging(target)
    staging.commit(target)
    marker = target / staging.COMPLETE_MARKER
    record = json.loads(marker.read_text())
    marker.write_text(json.dumps({**record, "time": committed_at}))


def test_the_newest_commit_wins_whatever_the_names(tmp_path: Path) -> None:
    _commit(tmp_path / "step=9.ckpt", committed_at=100.0)
    _commit(tmp_path / "step=12.ckpt", committed_at=200.0)  # sorts before step=9 by name
    _commit(tmp_path / "last.ckpt", committed_at=150.0)
    assert newest_complete_checkpoint(tmp_path) == tmp_path / "step=12.ckpt"


def test_interrupted_saves_and_unmarked_directories_never_count(tmp_path: Path) -> None:
    _commit(tmp_path / "step=3.ckpt", committed_at=100.0)
    staging.prepare_staging(tmp_path / "step=6.ckpt")  # killed mid-save: only the staging directory exists
    (tmp_path / "plain").mkdir()  # no completion marker
    assert newest_complete_checkpoint(tmp_path) == tmp_path / "step=3.ckpt"
    assert incomplete_checkpoints(tmp_path) == [tmp_path / "step=6.ckpt.lightspeed-staging"]
    assert describe_skipped(incomplete_checkpoints(tmp_path)) == (
        f"{str(tmp_path / 'step=6.ckpt.lightspeed-staging')!r} (an interrupted save; removed at the next save)"
    )


def test_single_file_checkpoints_count_by_modification_time(tmp_path: Path) -> None:
    older, newer = tmp_path / "step=9.ckpt", tmp_path / "step=12.ckpt"
    for path, when in ((older, 1_000), (newer, 2_000)):
        path.write_text("weights")
        os.utime(path, (when, when))
    (tmp_path / "step=15.ckpt.lightspeed-staging").write_text("half")  # a file torn by a kill mid-save
    assert newest_complete_checkpoint(tmp_path) == newer


def test_no_directory_or_nothing_complete_is_a_fresh_start(tmp_path: Path) -> None:
    assert newest_complete_checkpoint(tmp_path / "missing") is None
    staging.prepare_staging(tmp_path / "step=3.ckpt")
    assert newest_complete_checkpoint(tmp_path) is None
