"""A checkpoint directory every rank writes into, committed only when every rank succeeded.

:class:`StagedCheckpointSaver` saves in three phases (rank 0 prepares the staging directory, every rank writes, rank 0
commits), each followed by an agreement across ranks
(:func:`~lightspeed.core.common.distributed.raise_on_every_rank`), so no rank waits for one that hit a full disk.
Node-local checkpoints (``node=`` a :class:`~lightspeed.core.reliability.node_local.NodePosition`): every node's local
rank 0 does what rank 0 does for its own directory; all nodes' commits carry one ``save_id``, and the save succeeded
only when every node committed (see :mod:`lightspeed.core.reliability.node_local`). Built on the primitives of
:mod:`lightspeed.core.reliability.staging`.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightspeed.core.common.distributed import global_rank, is_distributed, raise_on_every_rank, values_by_rank
from lightspeed.core.errors import CheckpointError
from lightspeed.core.reliability import staging as atomic_dir  # by module: a test replaces its functions
from lightspeed.core.reliability.node_local import NODE_LOCAL_KEY, NodePosition, node_manifest

__all__ = ["StagedCheckpointSaver", "each_rank_its_own_path"]


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
        node: NodePosition | None = None,
        rank_local: bool = False,
    ) -> Path:
        """Run ``write(staging_dir)`` on every rank and commit ``target`` once all succeeded (a collective: every rank
        calls it with the same ``target``). ``extra_files`` (name -> text) and ``manifest`` are written by rank 0, or
        with ``node`` (node-local storage) by every node's local rank 0 into its node's own ``target``.

        ``rank_local``: every rank passes a ``target`` of its own and commits it; rank 0's marker lists every rank's
        files, so the directories merged into one (as Ray Train merges what each worker reports) are one complete
        checkpoint. Two ranks that wrote the same file name: a :class:`CheckpointError` (the merge would lose one)."""
        target = Path(target)
        staging = atomic_dir.staging_path(target)
        is_writer = rank_local or (node.local_rank == 0 if node is not None else global_rank() == 0)
        if node is not None:
            manifest = {**manifest, NODE_LOCAL_KEY: {"save_id": _agreed_save_id()}}

        def prepare_phase() -> None:
            if is_writer:
                # leftovers of saves that crashed in an earlier run; not beside a rank-local target, whose siblings
                # may be the staging directories of other ranks at work (prepare_staging clears this one's own)
                if not self._swept_staging and not rank_local:
                    atomic_dir.remove_stale_staging(staging.parent)
                    self._swept_staging = True
                atomic_dir.prepare_staging(target)

        def extras_phase() -> None:
            if rank_local and global_rank() == 0:
                for name, text in (extra_files or {}).items():
                    (staging / name).write_text(text)

        def commit_phase() -> None:
            if rank_local:
                _commit_rank_local(target, manifest)
            elif is_writer:
                for name, text in (extra_files or {}).items():
                    (staging / name).write_text(text)
                record = manifest
                if node is not None:
                    record = {
                        **manifest,
                        NODE_LOCAL_KEY: node_manifest(node, manifest[NODE_LOCAL_KEY]["save_id"], staging),
                    }
                atomic_dir.commit(target, manifest=record)

        what = f"Saving checkpoint {str(target)!r}"
        for phase in (prepare_phase, lambda: write(staging), extras_phase, commit_phase):
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


def each_rank_its_own_path(path: str | os.PathLike[str]) -> bool:
    """True when every rank passed a different ``path``, False when all passed the same (a collective); a
    :class:`CheckpointError` when some share one and some do not."""
    paths = values_by_rank(str(path))
    if len(set(paths)) == 1:
        return False
    if len(set(paths)) == len(paths):
        return True
    raise CheckpointError(
        f"The ranks asked to save checkpoints to {sorted(set(paths))}: some ranks share a path and some do not. Pass "
        "the same path on every rank, or a different path on each rank (one directory per worker, as Ray Train's "
        "report directories are)."
    )


def _commit_rank_local(target: Path, manifest: dict[str, Any]) -> None:
    """Every rank's staged files gathered (a collective); rank 0 commits its ``target`` with a marker listing them
    all, the other ranks move theirs into place without one (their files belong to rank 0's checkpoint)."""
    staging = atomic_dir.staging_path(target)
    by_rank = values_by_rank(atomic_dir.staged_files(staging))
    files: dict[str, int] = {}
    for rank, listed in enumerate(by_rank):
        clashes = sorted(set(files) & set(listed))
        if clashes:
            raise CheckpointError(
                f"Saving checkpoint {str(target)!r}: rank {rank} wrote {clashes[0]!r}, which an earlier rank wrote "
                "too; merged into one checkpoint, one would replace the other. Give every rank its own checkpoint "
                "path only where each writes its own files (lightspeed's Ray strategy does)."
            )
        files.update(listed)
    if global_rank() == 0:
        atomic_dir.commit(target, manifest=manifest, files=files)
    else:
        atomic_dir.swap_into_place(staging, target)


def _agreed_save_id() -> str:
    """A random id for one save, the same on every rank (rank 0's)."""
    import torch.distributed as dist

    ids = [uuid.uuid4().hex]
    if is_distributed():
        dist.broadcast_object_list(ids, src=0)
    return ids[0]
