"""What a resume would skip: the incomplete checkpoints an interrupted save leaves in a checkpoint directory.

lightspeed commits a checkpoint by renaming a complete staging directory onto its name, so an interrupted save leaves
``<name>.lightspeed-staging`` (never a checkpoint: Lightning's ``ckpt_path="last"`` only considers names ending in
``.ckpt``), or, when killed between the two renames of a replacement, ``<name>.lightspeed-replaced`` holding the
previous complete version while ``<name>`` is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

from lightspeed.core.atomic_dir import REPLACED_SUFFIX as _REPLACED_SUFFIX
from lightspeed.core.atomic_dir import STAGING_SUFFIX as _STAGING_SUFFIX

__all__ = ["describe_skipped", "incomplete_checkpoints"]


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
