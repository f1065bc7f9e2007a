"""Resume a ZeRO checkpoint on another number of processes, through DeepSpeed's universal checkpoint format.

A ZeRO checkpoint holds each rank's flat partition of the fp32 master weights and of the optimizer states; a run on
another number of processes partitions differently, and DeepSpeed's ``load_checkpoint`` refuses (or mis-slices)
such files. DeepSpeed's ``ds_to_universal`` rewrites them one parameter at a time (one rank file in memory at a
time, then one parameter's fragments) as per-parameter files (``fp32``, ``exp_avg``, ``exp_avg_sq``, ...), which an
engine of any size loads with ``checkpoint.load_universal``. lightspeed converts into a hidden directory beside the
checkpoint, loads, and deletes it; the checkpoint itself is never modified.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

from lightspeed.core.reliability.staging import COMPLETE_MARKER

__all__ = ["UNIVERSAL_SUFFIX", "convert_to_universal", "remove_universal", "saved_world_size", "universal_path"]

UNIVERSAL_SUFFIX = ".lightspeed-universal"


def saved_world_size(checkpoint: str | os.PathLike[str]) -> int | None:
    """The number of processes that wrote ``checkpoint`` (from lightspeed's completion marker), None if unknown."""
    marker = Path(checkpoint) / COMPLETE_MARKER
    if not marker.is_file():
        return None
    value = json.loads(marker.read_text()).get("world_size")
    return int(value) if value is not None else None


def universal_path(checkpoint: str | os.PathLike[str]) -> Path:
    """Where the universal version of ``checkpoint`` is written while it is loaded (removed afterwards)."""
    checkpoint = Path(checkpoint)
    return checkpoint.with_name(checkpoint.name + UNIVERSAL_SUFFIX)


def convert_to_universal(checkpoint: str | os.PathLike[str], tag: str) -> Path:
    """Write the universal version of ``checkpoint/tag`` to ``universal_path(checkpoint)/tag`` (one process);
    returns the universal directory. DeepSpeed's progress output is swallowed."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    target = universal_path(checkpoint)
    if target.exists():
        shutil.rmtree(target)
    args = argparse.Namespace(
        input_folder=str(Path(checkpoint) / tag),
        output_folder=str(target / tag),
        num_extract_workers=1,  # in this process: no worker pool forked from a distributed process
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ds_to_universal(args)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    (target / "latest_universal").write_text(tag)
    return target


def remove_universal(checkpoint: str | os.PathLike[str]) -> Any:
    """Delete the universal version of ``checkpoint`` (one process, after every rank loaded it)."""
    shutil.rmtree(universal_path(checkpoint), ignore_errors=True)
