"""Resuming a Fabric loop: the newest complete checkpoint that ``fabric.save`` wrote into a directory, the Fabric
counterpart of the Trainer's ``ckpt_path="last"``."""

from __future__ import annotations

import os
from pathlib import Path

from lightning.fabric import Fabric
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightspeed.core.reliability.last_checkpoint import (
    describe_skipped,
    incomplete_checkpoints,
    newest_complete_checkpoint,
)

__all__ = ["last_checkpoint"]


def last_checkpoint(fabric: Fabric, directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint in ``directory`` committed last, or None for a fresh start (a collective: rank 0 looks and
    every rank gets its answer). Interrupted saves are skipped, with a warning naming them::

        ckpt = lightspeed.fabric.last_checkpoint(fabric, "ckpts")
        if ckpt is not None:
            fabric.load(ckpt, state)

    Args:
        fabric: the launched ``Fabric`` (its strategy's ranks are asked).
        directory: the directory ``fabric.save`` writes its checkpoints into; a missing directory means a fresh start.
    """
    found: str | None = None
    if fabric.global_rank == 0:
        newest = newest_complete_checkpoint(directory)
        found = str(newest) if newest is not None else None
        leftovers = incomplete_checkpoints(directory)
        if leftovers:
            rank_zero_warn(
                f"lightspeed: {'resuming from ' + repr(found) if found else 'starting fresh'}; skipped "
                f"{len(leftovers)} incomplete checkpoint(s): {describe_skipped(leftovers)}."
            )
    found = fabric.broadcast(found)
    return Path(found) if found is not None else None
