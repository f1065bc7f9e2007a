"""Crash-safe saving of a checkpoint directory that every rank writes into.

Three phases, each followed by an agreement across ranks (:func:`~lightspeed.core.distributed.raise_on_every_rank`):

1. *prepare* (rank 0): sweep the staging leftovers of saves that crashed in an earlier run (once per saver) and
   create an empty staging directory next to the target;
2. *write* (every rank): the caller's writer fills the staging directory (for DeepSpeed: ``engine.save_checkpoint``);
3. *commit* (rank 0): extra files, the completion marker, then one atomic rename onto the target.

A failure in any phase on any rank raises on every rank, so no rank waits for one that hit a full disk, and the
previous checkpoint at the target is untouched.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightspeed.core import atomic_dir
from lightspeed.core.distributed import global_rank, raise_on_every_rank

__all__ = ["StagedCheckpointSaver"]


class StagedCheckpointSaver:
    """Saves checkpoint directories through staging and commit; remembers whether stale staging was swept."""

    def __init__(self) -> None:
        self._swept_staging = False

    def save(
        self,
        target: str | os.PathLike[str],
        write: Callable[[Path], None],
        *,
        manifest: dict[str, Any],
        extra_files: dict[str, str] | None = None,
    ) -> Path:
        """Run ``write(staging_dir)`` on every rank and commit ``target`` once all succeeded (a collective: every rank
        calls it with the same ``target``). ``extra_files`` (name -> text) and ``manifest`` are written by rank 0."""
        target = Path(target)
        staging = atomic_dir.staging_path(target)
        is_writer = global_rank() == 0

        def prepare() -> None:
            if is_writer:
                if not self._swept_staging:  # leftovers of saves that crashed in an earlier run
                    atomic_dir.remove_stale_staging(staging.parent)
                    self._swept_staging = True
                atomic_dir.prepare_staging(target)

        def commit() -> None:
            if is_writer:
                for name, text in (extra_files or {}).items():
                    (staging / name).write_text(text)
                atomic_dir.commit(target, manifest=manifest)

        what = f"Saving checkpoint {str(target)!r}"
        for phase in (prepare, lambda: write(staging), commit):
            error: BaseException | None = None
            try:
                phase()
            except Exception as err:  # noqa: BLE001 - re-raised on this rank, reported on the others
                error = err
            raise_on_every_rank(
                error,
                what,
                others_message=f"{what} failed on another rank (its own error says why); the previous checkpoint "
                "is untouched.",
            )
        return target
