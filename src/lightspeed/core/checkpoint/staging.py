"""Write an export into a hidden staging directory and rename it into place, so the output directory holds a
complete export or is left exactly as it was (an error or Ctrl-C removes the staging directory)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lightspeed.core.atomic_dir import swap_into_place
from lightspeed.core.checkpoint.errors import ExportError
from lightspeed.core.distributed import global_rank, raise_on_every_rank

__all__ = ["check_output_dir", "check_output_dir_on_every_rank", "staged_output"]


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
