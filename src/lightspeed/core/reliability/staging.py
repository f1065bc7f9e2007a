"""Directories that appear complete or not at all: checkpoints and exports are written into a staging directory and
renamed into place, so a crash leaves the previous version or the new one, never a half-written one.

* The primitives: :func:`prepare_staging`, :func:`commit` (completion marker recording every file's size, then an
  atomic rename), :func:`swap_into_place` (replace a directory without a moment where neither exists under a known
  name), :func:`require_intact` (committed and no file truncated since).
* A checkpoint every rank writes into is built on them in :mod:`lightspeed.core.reliability.staged_saver`.
* :func:`staged_output`: an export written beside the output directory and swapped in, so the output directory
  holds a complete export or is left exactly as it was (an error or Ctrl-C removes the staging directory).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightspeed.core.common.distributed import global_rank, raise_on_every_rank
from lightspeed.core.errors import CheckpointError, ExportError, IncompleteCheckpointError

__all__ = [
    "COMPLETE_MARKER",
    "MODELS_MANIFEST_KEY",
    "REPLACED_SUFFIX",
    "STAGING_SUFFIX",
    "check_output_dir",
    "check_output_dir_on_every_rank",
    "commit",
    "damaged_files",
    "is_complete",
    "prepare_staging",
    "remove_stale_staging",
    "replaced_path",
    "require_complete",
    "require_intact",
    "save_file_atomically",
    "staged_files",
    "staged_output",
    "staging_path",
    "swap_into_place",
]

COMPLETE_MARKER = "lightspeed_complete.json"
#: the marker's key listing the trained models of a checkpoint of several models (each in its own sub-directory)
MODELS_MANIFEST_KEY = "models"
STAGING_SUFFIX = _STAGING_SUFFIX = ".lightspeed-staging"
REPLACED_SUFFIX = _REPLACED_SUFFIX = ".lightspeed-replaced"


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


def commit(
    target: str | os.PathLike, manifest: dict[str, Any] | None = None, files: dict[str, int] | None = None
) -> Path:
    """Mark the staging directory complete and move it onto ``target`` (one process, after all ranks finished). The
    marker records ``files`` (relative name -> size; default: what the staging directory holds)."""
    target = Path(target)
    staging = staging_path(target)
    if files is None:
        files = staged_files(staging)
    record = {"complete": True, "time": time.time(), **(manifest or {}), "files": files}
    marker_tmp = staging / (COMPLETE_MARKER + ".tmp")
    marker_tmp.write_text(json.dumps(record, indent=2, default=str))
    os.replace(marker_tmp, staging / COMPLETE_MARKER)
    swap_into_place(staging, target)
    return target


def staged_files(staging: str | os.PathLike) -> dict[str, int]:
    """The files under ``staging``, by name relative to it, with their sizes."""
    staging = Path(staging)
    return {str(p.relative_to(staging)): p.stat().st_size for p in sorted(staging.rglob("*")) if p.is_file()}


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


def several_models_in(directory: str | os.PathLike) -> list[str]:
    """The trained models of a committed checkpoint of several models, one engine each (each in
    ``directory/<name>``); empty for any other checkpoint."""
    marker = Path(directory) / COMPLETE_MARKER
    if not marker.is_file():
        return []
    return list(json.loads(marker.read_text()).get(MODELS_MANIFEST_KEY) or [])


def is_complete(directory: str | os.PathLike) -> bool:
    """True when ``directory`` carries the completion marker."""
    return (Path(directory) / COMPLETE_MARKER).is_file()


def require_complete(directory: str | os.PathLike) -> None:
    """Raise :class:`IncompleteCheckpointError` unless ``directory`` was committed by :func:`commit` (a folder inside
    a committed checkpoint, such as its ``checkpoint`` tag folder, is a :class:`CheckpointError` naming the
    checkpoint)."""
    directory = Path(directory)
    if not directory.exists() and replaced_path(directory).is_dir():
        raise IncompleteCheckpointError(
            f"Checkpoint {str(directory)!r} is missing, but {str(replaced_path(directory))!r} holds the previous "
            "version (a save was interrupted while swapping directories). Rename it back to resume from it."
        )
    if not directory.is_dir():
        raise IncompleteCheckpointError(f"Checkpoint {str(directory)!r} is not a directory.")
    enclosing = next((parent for parent in directory.parents[:2] if is_complete(parent)), None)
    if not is_complete(directory) and enclosing is not None:
        raise CheckpointError(
            f"{str(directory)!r} is a folder inside the checkpoint {str(enclosing)!r}, not a checkpoint of its own: "
            f"load the checkpoint directory itself, {str(enclosing)!r}."
        )
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


def save_file_atomically(target: str | os.PathLike, write: Callable[[Path], None], *, writer: bool) -> Path:
    """A single-file checkpoint that appears complete or not at all (a collective: every rank calls it): the
    ``writer`` rank runs ``write(staging_file)`` and renames it onto ``target``; a failure there is raised on every
    rank, and the previous file at ``target`` is untouched."""
    target = Path(target)
    staging = staging_path(target)
    error: Exception | None = None
    if writer:
        try:
            if staging.exists():
                _remove(staging)
            write(staging)
            os.replace(staging, target)
        except Exception as err:  # noqa: BLE001 - re-raised on this rank, reported on the others
            error = err
    raise_on_every_rank(error, f"Saving checkpoint {str(target)!r}")
    return target


# ---------------------------------------------------------------------------------------- exports
def check_output_dir(output_dir: str | os.PathLike, overwrite: bool) -> Path:
    """Refuse an output path that is a file, or a non-empty directory unless ``overwrite``."""
    out = Path(output_dir)
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise ExportError(f"output path {out} exists and is not a directory; choose a directory path")
        if not overwrite and any(out.iterdir()):
            raise ExportError(
                f"output directory {out} exists and is not empty; pass overwrite=True (--overwrite on the command "
                "line) to replace it, or choose another directory"
            )
    return out


def check_output_dir_on_every_rank(output_dir: str | os.PathLike, overwrite: bool) -> None:
    """Rank 0 runs :func:`check_output_dir` (the rank that writes); every rank raises its ExportError, so none is
    left waiting in the next collective. A collective: every rank must call it."""
    problem = None
    if global_rank() == 0:
        try:
            check_output_dir(output_dir, overwrite)
        except ExportError as error:
            problem = error
    raise_on_every_rank(problem, "checking the output directory", error_type=ExportError)


@contextmanager
def staged_output(output_dir: str | os.PathLike, overwrite: bool) -> Iterator[Path]:
    """Yield an empty staging directory beside ``output_dir``; on success it replaces ``output_dir``."""
    out = check_output_dir(output_dir, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging = out.parent / f".{out.name}.lightspeed-export-{token}"
    staging.mkdir()
    try:
        yield staging
        check_output_dir(out, overwrite)  # it may have been filled while we were writing
        swap_into_place(staging, out)  # the old directory is renamed back if the new one cannot move in
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
