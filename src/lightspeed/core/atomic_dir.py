"""Directories that appear complete or not at all.

A checkpoint is a directory written by every rank. Writing it in place means a crash mid-save leaves a directory
that looks like a checkpoint but is not. Instead every rank writes into a staging directory next to the target;
once all ranks are done (the caller synchronises), one process writes a completion marker and renames the staging
directory onto the target. ``rename`` is atomic on POSIX file systems, so readers see the old complete checkpoint or
the new complete one.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

COMPLETE_MARKER = "lightspeed_complete.json"
_STAGING_SUFFIX = ".lightspeed-staging"
_REPLACED_SUFFIX = ".lightspeed-replaced"


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint directory that was not completely written."""


def staging_path(target: str | os.PathLike) -> Path:
    """Where the ranks write before the directory is committed to ``target``."""
    target = Path(target)
    return target.with_name(target.name + _STAGING_SUFFIX)


def prepare_staging(target: str | os.PathLike) -> Path:
    """Remove leftovers of an earlier interrupted save and return an empty staging directory (one process)."""
    staging = staging_path(target)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def commit(target: str | os.PathLike, manifest: dict[str, Any] | None = None) -> Path:
    """Mark the staging directory complete and move it onto ``target`` (one process, after all ranks finished)."""
    target = Path(target)
    staging = staging_path(target)
    record = {"complete": True, "time": time.time(), **(manifest or {})}
    marker_tmp = staging / (COMPLETE_MARKER + ".tmp")
    marker_tmp.write_text(json.dumps(record, indent=2, default=str))
    os.replace(marker_tmp, staging / COMPLETE_MARKER)
    if target.exists() or target.is_symlink():
        replaced = target.with_name(target.name + _REPLACED_SUFFIX)
        if replaced.exists():
            _remove(replaced)
        os.replace(target, replaced)
        os.replace(staging, target)
        _remove(replaced)
    else:
        os.replace(staging, target)
    return target


def is_complete(directory: str | os.PathLike) -> bool:
    """True when ``directory`` carries the completion marker."""
    return (Path(directory) / COMPLETE_MARKER).is_file()


def require_complete(directory: str | os.PathLike) -> None:
    """Raise :class:`IncompleteCheckpointError` unless ``directory`` was committed by :func:`commit`."""
    directory = Path(directory)
    if not directory.is_dir():
        raise IncompleteCheckpointError(f"Checkpoint {str(directory)!r} is not a directory.")
    if not is_complete(directory):
        raise IncompleteCheckpointError(
            f"Checkpoint {str(directory)!r} has no {COMPLETE_MARKER!r}: it was not written completely (the save was "
            "interrupted, or it was not written by lightspeed). Resume from an earlier checkpoint instead."
        )


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
