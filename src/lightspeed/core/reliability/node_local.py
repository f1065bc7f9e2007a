"""Node-local checkpoints: each node keeps its own ranks' files in its own directory (no shared filesystem).

With DeepSpeed's ``checkpoint.use_node_local_storage`` every node writes the ZeRO shards of its own ranks plus the
non-sharded model states; lightspeed adds what every node needs (``latest``, ``ds_config.json``) and, per node, the
completion marker of :mod:`lightspeed.core.reliability.staging` with a ``node_local`` record:

* ``save_id``: the same random id on every node for one save (parts of different saves are never mixed);
* ``node_rank``, ``num_nodes``, ``world_size`` and ``ranks_per_node`` (which global ranks each node ran);
* ``rank_files``: per rank of this node, the files written for it (relative to the checkpoint directory).

A checkpoint counts as complete when every node's directory holds a committed part with the same ``save_id``: resume
checks its own node's part, then agrees across all ranks; export is given every node's directory and checks them all.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightspeed.core.errors import CheckpointError, IncompleteCheckpointError
from lightspeed.core.reliability import staging as atomic_dir

__all__ = [
    "node_local_path",
    "NODE_LOCAL_KEY",
    "NodeLocalPart",
    "NodePosition",
    "check_parts",
    "describe_position",
    "rank_files",
    "read_part",
]

NODE_LOCAL_KEY = "node_local"
_RANK_IN_NAME = re.compile(r"zero_pp_rank_(\d+)_|^offloaded_tensors/rank0*(\d+)/")


@dataclass(frozen=True)
class NodePosition:
    """Where this process sits: its node, its global rank and which global ranks each node runs."""

    node_rank: int
    global_rank: int
    local_rank: int
    ranks_per_node: dict[int, list[int]]

    @property
    def num_nodes(self) -> int:
        return len(self.ranks_per_node)

    @property
    def world_size(self) -> int:
        return sum(len(ranks) for ranks in self.ranks_per_node.values())

    @property
    def node_ranks(self) -> list[int]:
        return self.ranks_per_node[self.node_rank]


def describe_position(node_rank: int, local_rank: int) -> NodePosition:
    """This process's :class:`NodePosition` (a collective: every rank calls it)."""
    import torch.distributed as dist

    from lightspeed.core.common.distributed import global_rank, is_distributed

    rank = global_rank()
    pairs: list[Any] = [(rank, node_rank)]
    if is_distributed():
        pairs = [None] * dist.get_world_size()
        dist.all_gather_object(pairs, (rank, node_rank))
    per_node: dict[int, list[int]] = {}
    for member, node in sorted(pairs):
        per_node.setdefault(int(node), []).append(int(member))
    return NodePosition(node_rank, rank, local_rank, dict(sorted(per_node.items())))


def rank_files(directory: Path, ranks: Sequence[int]) -> dict[str, list[str]]:
    """The files under ``directory`` that belong to one of ``ranks`` (ZeRO shards, NVMe swap copies), by rank."""
    found: dict[str, list[str]] = {str(rank): [] for rank in ranks}
    for path in sorted(directory.rglob("*")):
        if not path.is_file():
            continue
        relative = path.relative_to(directory).as_posix()
        inner = relative.split("/", 1)[1] if "/" in relative else relative  # below the tag folder
        match = _RANK_IN_NAME.search(inner)
        if match:
            rank = match.group(1) or match.group(2)
            if rank in found:
                found[rank].append(relative)
    return found


def node_manifest(position: NodePosition, save_id: str, staging: Path) -> dict[str, Any]:
    """The ``node_local`` record of this node's completion marker (called by the node's writer at commit)."""
    return {
        "save_id": save_id,
        "node_rank": position.node_rank,
        "num_nodes": position.num_nodes,
        "world_size": position.world_size,
        "ranks_per_node": {str(node): ranks for node, ranks in position.ranks_per_node.items()},
        "rank_files": rank_files(staging, position.node_ranks),
        "common_files": common_files(staging),
    }


def common_files(directory: Path) -> list[str]:
    """The files under ``directory`` that belong to no rank (``latest``, the non-sharded model states, configs)."""
    names = []
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory).as_posix()
        inner = relative.split("/", 1)[1] if "/" in relative else relative
        if path.is_file() and not _RANK_IN_NAME.search(inner) and not relative.startswith(atomic_dir.COMPLETE_MARKER):
            names.append(relative)
    return names


@dataclass
class NodeLocalPart:
    """One node's committed directory of a node-local checkpoint, as its marker describes it."""

    path: Path
    save_id: str
    node_rank: int
    num_nodes: int
    world_size: int
    ranks_per_node: dict[int, list[int]]
    rank_files: dict[int, list[str]]
    common_files: list[str]
    global_step: Any = None

    def missing_common(self) -> list[str]:
        """Files every node needs (``latest``, the non-sharded model states) that are missing here."""
        return [name for name in self.common_files if not (self.path / name).is_file()]

    def missing_ranks(self) -> dict[int, list[str]]:
        """This node's ranks whose recorded files are missing (or whose record is empty), with the missing names."""
        missing: dict[int, list[str]] = {}
        for rank in self.ranks_per_node.get(self.node_rank, []):
            names = self.rank_files.get(rank, [])
            absent = [name for name in names if not (self.path / name).is_file()]
            if absent or not names:
                missing[rank] = absent or ["(no files recorded)"]
        return missing


def read_part(path: str | os.PathLike) -> NodeLocalPart | None:
    """The node-local record of the committed checkpoint directory ``path``; None when it is not node-local (or
    not committed by lightspeed)."""
    path = Path(path)
    marker = path / atomic_dir.COMPLETE_MARKER
    if not marker.is_file():
        return None
    try:
        record = json.loads(marker.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{marker}: unreadable completion marker ({err})") from None
    info = record.get(NODE_LOCAL_KEY)
    if not isinstance(info, dict):
        return None
    return NodeLocalPart(
        path=path,
        save_id=str(info["save_id"]),
        node_rank=int(info["node_rank"]),
        num_nodes=int(info["num_nodes"]),
        world_size=int(info["world_size"]),
        ranks_per_node={int(k): [int(r) for r in v] for k, v in info["ranks_per_node"].items()},
        rank_files={int(k): list(v) for k, v in info["rank_files"].items()},
        common_files=list(info.get("common_files", [])),
        global_step=record.get("global_step"),
    )


def _ranks_text(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def require_part(path: str | os.PathLike, node_rank: int | None = None) -> NodeLocalPart:
    """The node-local part at ``path``, checked to be committed and to hold every file of its node's ranks.

    Raises :class:`CheckpointError` naming the node and the ranks whose files are missing."""
    path = Path(path)
    where = f"node {node_rank}" if node_rank is not None else "this node"
    if not path.exists():
        raise CheckpointError(
            f"{where} has no checkpoint at {str(path)!r}: a node-local checkpoint needs every node's own directory "
            "(each node resumes from the directory it saved into). Copy the node's directory back, or resume from an "
            "earlier checkpoint."
        )
    try:
        atomic_dir.require_complete(path)
    except IncompleteCheckpointError as err:
        raise CheckpointError(f"{where}: {err}") from None
    part = read_part(path)
    if part is None:
        raise CheckpointError(
            f"{str(path)!r} ({where}) is not a node-local checkpoint (its completion marker has no "
            f"{NODE_LOCAL_KEY!r} record); load it without node_local_storage=True."
        )
    missing = part.missing_ranks()
    if missing:
        ranks = sorted(missing)
        names = "; ".join(f"rank {rank}: {', '.join(files)}" for rank, files in sorted(missing.items()))
        raise CheckpointError(
            f"node {part.node_rank}'s checkpoint directory {str(path)!r} is missing the files of rank(s) "
            f"{_ranks_text(ranks)} ({names}). Copy them back from where node {part.node_rank} saved them, or resume "
            "from an earlier checkpoint."
        )
    common = part.missing_common()
    if common:
        raise CheckpointError(
            f"node {part.node_rank}'s checkpoint directory {str(path)!r} is missing {', '.join(common)} (needed by "
            f"every node; ranks {_ranks_text(part.ranks_per_node.get(part.node_rank, []))}). Copy them back, or "
            "resume from an earlier checkpoint."
        )
    return part


def check_parts(parts: Sequence[NodeLocalPart]) -> None:
    """Every node's part is there exactly once, and all come from the same save; else :class:`CheckpointError`."""
    first = parts[0]
    for part in parts[1:]:
        if part.save_id != first.save_id:
            raise CheckpointError(
                f"{str(part.path)!r} (node {part.node_rank}) and {str(first.path)!r} (node {first.node_rank}) are "
                f"parts of different saves (global step {part.global_step} and {first.global_step}): a node did not "
                "commit the latest save. Use the directories of one save, or an earlier checkpoint."
            )
    seen: dict[int, Path] = {}
    for part in parts:
        if part.node_rank in seen:
            raise CheckpointError(
                f"{str(seen[part.node_rank])!r} and {str(part.path)!r} are both node {part.node_rank}'s part; pass "
                "each node's directory once"
            )
        seen[part.node_rank] = part.path
    absent = [node for node in range(first.num_nodes) if node not in seen]
    if absent:
        ranks = sorted(r for node in absent for r in first.ranks_per_node.get(node, []))
        raise CheckpointError(
            f"the node-local checkpoint was saved by {first.num_nodes} nodes, but the directory of node(s) "
            f"{_ranks_text(absent)} (ranks {_ranks_text(ranks)}) was not given; pass every node's directory, e.g. "
            "`lightspeed export node0/last.ckpt node1/last.ckpt OUT`."
        )


def node_local_path(path: str, rank_zero_cwd: str) -> str:
    """Rank 0's checkpoint ``path`` as this node's path: a path under rank 0's working directory ``rank_zero_cwd`` is
    taken under this process's working directory, so nodes launched in different directories each keep their own
    checkpoints (the front ends resolve and broadcast rank 0's absolute path); any other path is used as it is."""
    root = Path(rank_zero_cwd)
    target = Path(path)
    if target.is_absolute() and target.is_relative_to(root):
        return str(Path.cwd() / target.relative_to(root))
    return path
