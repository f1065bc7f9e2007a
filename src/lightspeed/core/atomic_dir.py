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
STAGING_SUFFIX = _STAGING_SUFFIX = ".lightspeed-staging"
REPLACED_SUFFIX = _REPLACED_SUFFIX = ".lightspeed-replaced"


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
    files = {str(p.relative_to(staging)): p.stat().st_size for p in sorted(staging.rglob("*")) if p.is_file()}
    record = {"complete": True, "time": time.time(), **(manifest or {}), "files": files}
    marker_tmp = staging / (COMPLETE_MARKER + ".tmp")
    marker_tmp.write_text(json.dumps(record, indent=2, default=str))
    os.replace(marker_tmp, staging / COMPLETE_MARKER)
    swap_into_place(staging, target)
    return target


def swap_into_place(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Rename directory ``source`` onto ``target``, replacing what is there, without a moment where neither exists
    under a known name: the old one is first renamed aside (``<target>.lightspeed-replaced``), and renamed back if
    the second rename fails. Only after the new one is in place is the old one deleted."""
    source, target = Path(source), Path(target)
    if not (target.exists() or target.is_symlink()):
        os.replace(source, target)
        return
    replaced = replaced_path(target)
    if replaced.exists():
        _remove(replaced)
    os.replace(target, replaced)
    try:
        os.replace(source, target)
    except BaseException:
        os.replace(replaced, target)
        raise
    _remove(replaced)


def replaced_path(target: str | os.PathLike) -> Path:
    """Where :func:`swap_into_place` keeps the previous directory while the new one moves in."""
    target = Path(target)
    return target.with_name(target.name + _REPLACED_SUFFIX)


def remove_stale_staging(directory: str | os.PathLike, keep: str | os.PathLike | None = None) -> list[Path]:
    """Delete staging directories of interrupted saves in ``directory`` (except ``keep``); returns what went."""
    removed = []
    keep_path = Path(keep).resolve() if keep is not None else None
    for leftover in Path(directory).glob("*" + _STAGING_SUFFIX):
        if leftover.is_dir() and leftover.resolve() != keep_path:
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(leftover)
    return removed


def is_complete(directory: str | os.PathLike) -> bool:
    """True when ``directory`` carries the completion marker."""
    return (Path(directory) / COMPLETE_MARKER).is_file()


def require_complete(directory: str | os.PathLike) -> None:
    """Raise :class:`IncompleteCheckpointError` unless ``directory`` was committed by :func:`commit`."""
    directory = Path(directory)
    if not directory.exists() and replaced_path(directory).is_dir():
        raise IncompleteCheckpointError(
            f"Checkpoint {str(directory)!r} is missing, but {str(replaced_path(directory))!r} holds the previous "
            "version (a save was interrupted while swapping directories). Rename it back to resume from it."
        )
    if not directory.is_dir():
        raise IncompleteCheckpointError(f"Checkpoint {str(directory)!r} is not a directory.")
    if not is_complete(directory):
        raise IncompleteCheckpointError(
            f"Checkpoint {str(directory)!r} has no {COMPLETE_MARKER!r}: it was not written completely (the save was "
            "interrupted, or it was not written by lightspeed). Resume from an earlier checkpoint instead."
        )


def damaged_files(directory: str | os.PathLike, include_missing: bool = True) -> list[str]:
    """Files of a committed ``directory`` that are missing or whose size differs from the size recorded at commit
    (a truncated or replaced shard), as ``"<name> (<what>)"``; empty for an intact directory or an old marker that
    recorded no sizes. Sizes only: a same-size corruption is not detected (hashing big shards would cost minutes)."""
    directory = Path(directory)
    recorded = json.loads((directory / COMPLETE_MARKER).read_text()).get("files") or {}
    problems = []
    for name, size in recorded.items():
        path = directory / name
        if not path.is_file():
            if include_missing:
                problems.append(f"{name} (missing)")
        elif path.stat().st_size != size:
            problems.append(f"{name} ({path.stat().st_size} bytes, {size} when written)")
    return problems


def require_intact(directory: str | os.PathLike, include_missing: bool = True) -> None:
    """:func:`require_complete`, and every file still has the size it had when committed (``include_missing=False``:
    missing files are left to the reader, whose error says which rank's file is missing)."""
    require_complete(directory)
    problems = damaged_files(directory, include_missing)
    if problems:
        raise IncompleteCheckpointError(
            f"Checkpoint {str(Path(directory))!r} is damaged: {', '.join(problems)}. It changed after it was written "
            "(a truncated copy, a full disk while copying, or a file replaced). Resume from an earlier checkpoint."
        )


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
