"""Which checkpoint a resume starts from: the newest complete one in a directory, and what it skips (the incomplete
checkpoints an interrupted save leaves).

lightspeed commits a checkpoint by renaming a complete staging directory onto its name, so an interrupted save leaves
``<name>.lightspeed-staging`` (never a checkpoint: Lightning's ``ckpt_path="last"`` only considers names ending in
``.ckpt``), or, when killed between the two renames of a replacement, ``<name>.lightspeed-replaced`` holding the
previous complete version while ``<name>`` is missing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lightspeed.core.reliability.staging import COMPLETE_MARKER, is_complete
from lightspeed.core.reliability.staging import REPLACED_SUFFIX as _REPLACED_SUFFIX
from lightspeed.core.reliability.staging import STAGING_SUFFIX as _STAGING_SUFFIX

__all__ = ["describe_skipped", "incomplete_checkpoints", "newest_complete_checkpoint"]


def newest_complete_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint in ``directory`` committed last; None when there is none (or no directory).

    Directories count when committed completely (ZeRO checkpoints, ordered by the commit time lightspeed's marker
    records), files as they are (single-file checkpoints, which lightspeed renames into place once written, ordered by
    modification time). Leftovers of interrupted saves never count."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found: list[tuple[float, str, Path]] = []
    for path in directory.iterdir():
        if path.name.endswith(_SUFFIXES):
            continue
        if path.is_dir() and is_complete(path):
            committed = float(json.loads((path / COMPLETE_MARKER).read_text()).get("time", 0))
            found.append((committed, path.name, path))
        elif path.is_file():
            found.append((path.stat().st_mtime, path.name, path))
    return max(found)[2] if found else None


_SUFFIXES = (_STAGING_SUFFIX, _REPLACED_SUFFIX)


def incomplete_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """Leftovers of interrupted saves in ``directory`` (sorted); a missing directory has none."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.name.endswith((_STAGING_SUFFIX, _REPLACED_SUFFIX))]
    return sorted(found)


def describe_skipped(leftovers: list[Path]) -> str:
    """One sentence per leftover: what it is and what happens to it."""
    parts = []
    for path in leftovers:
        if path.name.endswith(_REPLACED_SUFFIX):
            original = path.with_name(path.name[: -len(_REPLACED_SUFFIX)])
            parts.append(
                f"{str(path)!r} holds the previous complete version of {str(original)!r} (a save was killed while "
                f"swapping directories); rename it to {original.name!r} to resume from it"
            )
        else:
            parts.append(f"{str(path)!r} (an interrupted save; removed at the next save)")
    return "; ".join(parts)
