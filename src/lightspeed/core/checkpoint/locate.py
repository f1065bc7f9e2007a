"""Find the files of a DeepSpeed checkpoint: the tag directory and the model/optimizer file of every rank.

Accepted inputs: the directory DeepSpeed's ``save_checkpoint`` wrote into (a ``latest`` file naming the tag, one
sub-directory per tag; Lightning's ``<name>.ckpt/`` directories look exactly like this with the tag
``checkpoint``), or a tag directory itself. A node-local checkpoint (each node wrote its own ranks' files into its
own directory) is given as the list of every node's directory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lightspeed.core.errors import CheckpointError
from lightspeed.core.reliability import node_local

__all__ = ["CheckpointFiles", "find_tag_dir", "locate"]

_MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_FILE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


@dataclass
class CheckpointFiles:
    """Where one tag of a checkpoint lives and which rank files it has."""

    tag_dir: Path
    tag: str
    model_files: dict[int, Path]  # data-parallel rank -> model states (stage 3: one per rank; else rank 0 only)
    optim_files: dict[int, Path]  # data-parallel rank -> optimizer states (empty for plain stage 0)
    other_tag_dirs: list[Path] = field(default_factory=list)  # node-local: the other nodes' tag directories

    def offload_dir(self, rank: int) -> Path | None:
        """The folder DeepSpeed copies a rank's NVMe swap files into when it saves, if there is one."""
        for tag_dir in (self.tag_dir, *self.other_tag_dirs):
            for name in (f"rank{rank:02d}", f"rank{rank}"):
                candidate = tag_dir / "offloaded_tensors" / name
                if candidate.is_dir():
                    return candidate
        return None


def _is_tag_dir(path: Path) -> bool:
    return path.is_dir() and any(_MODEL_FILE.match(p.name) for p in path.iterdir())


def _tags_in(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if _is_tag_dir(p))


def find_tag_dir(checkpoint: str | os.PathLike, tag: str | None = None) -> tuple[Path, str]:
    """The tag directory of ``checkpoint`` (``tag``, else the one named in ``latest``)."""
    path = Path(checkpoint)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint (the path does not exist)")
    if path.is_file():
        raise CheckpointError(
            f"{path} is a file, not a DeepSpeed checkpoint directory. ZeRO checkpoints are directories "
            "(Lightning writes e.g. 'last.ckpt/' holding a 'latest' file and a 'checkpoint/' folder); read a "
            "single-file Lightning checkpoint with lightspeed.export.export_checkpoint, which accepts both"
        )
    if _is_tag_dir(path):
        if tag is not None and tag != path.name:
            raise CheckpointError(f"{path} is the tag directory {path.name!r}; it has no tag {tag!r}")
        return path, path.name
    tags = _tags_in(path)
    if tag is not None:
        if tag in tags:
            return path / tag, tag
        raise CheckpointError(f"unknown tag {tag!r} in {path}; available tags: {', '.join(tags) if tags else 'none'}")
    latest = path / "latest"
    if latest.is_file():
        named = latest.read_text().strip()
        if named in tags:
            return path / named, named
        raise CheckpointError(
            f"{latest} names the tag {named!r}, but {path / named} holds no '*_model_states.pt' file; "
            f"available tags: {', '.join(tags) if tags else 'none'}; pass one with tag=... (--tag on the command line)"
        )
    if len(tags) == 1:
        return path / tags[0], tags[0]
    if tags:
        raise CheckpointError(
            f"{path} has no 'latest' file and several tags ({', '.join(tags)}); pass one with tag=... (--tag on the "
            "command line)"
        )
    inside = _checkpoints_inside(path)
    raise CheckpointError(
        f"{path} is not a DeepSpeed checkpoint: it has neither a 'latest' file nor a tag directory holding "
        "'*_model_states.pt' files"
        + (
            f"; it holds the checkpoint(s) {', '.join(repr(name) for name in inside)} (a Ray Train checkpoint keeps "
            f"the strategy's checkpoint in such a folder): pass {str(path / inside[0])!r}"
            if inside
            else ""
        )
    )


def _checkpoints_inside(path: Path) -> list[str]:
    """The folders directly in ``path`` that are DeepSpeed checkpoints (a ``latest`` file, or a tag directory)."""
    return sorted(
        child.name for child in path.iterdir() if child.is_dir() and ((child / "latest").is_file() or _tags_in(child))
    )


CheckpointPath = str | os.PathLike[str]


def locate(checkpoint: CheckpointPath | Sequence[CheckpointPath], tag: str | None = None) -> CheckpointFiles:
    """Find the tag directory and the per-rank files; refuse tensor/pipeline-parallel and mixed layouts.

    ``checkpoint`` may be a list of directories: the per-node directories of one node-local checkpoint."""
    if not isinstance(checkpoint, (str, os.PathLike)):
        return locate_node_local(list(checkpoint), tag)
    part = node_local.read_part(checkpoint) if Path(checkpoint).is_dir() else None
    if part is not None and part.num_nodes > 1:
        node_local.check_parts([node_local.require_part(checkpoint)])  # raises: the other nodes' directories
    return _locate_one(checkpoint, tag)


def locate_node_local(checkpoints: list[CheckpointPath], tag: str | None = None) -> CheckpointFiles:
    """The files of a node-local checkpoint from every node's directory, checked to be one complete save."""
    if len(checkpoints) == 1:
        return locate(checkpoints[0], tag)
    if not checkpoints:
        raise CheckpointError("no checkpoint directory given")
    parts = []
    for path in checkpoints:
        if not Path(path).is_dir():
            raise CheckpointError(f"{path}: no such checkpoint directory (one node's part of a node-local checkpoint)")
        if node_local.read_part(path) is None:
            raise CheckpointError(
                f"{path} is not part of a node-local checkpoint (its completion marker has no node-local record); "
                "several directories are only accepted for checkpoints saved with node_local_storage=True"
            )
        parts.append(node_local.require_part(path))
    node_local.check_parts(parts)
    parts.sort(key=lambda p: p.node_rank)
    found = [_locate_one(part.path, tag) for part in parts]
    first = found[0]
    for other in found[1:]:
        if other.tag != first.tag:
            raise CheckpointError(f"{other.tag_dir} has the tag {other.tag!r}, {first.tag_dir} {first.tag!r}")
        for rank, path in other.model_files.items():
            first.model_files.setdefault(rank, path)
        for rank, path in other.optim_files.items():
            first.optim_files.setdefault(rank, path)
        first.other_tag_dirs.append(other.tag_dir)
    return first


def _locate_one(checkpoint: CheckpointPath, tag: str | None = None) -> CheckpointFiles:
    tag_dir, tag = find_tag_dir(checkpoint, tag)
    model_files: dict[int, Path] = {}
    optim_files: dict[int, Path] = {}
    optim_prefixes: set[str] = set()
    for entry in sorted(tag_dir.iterdir()):
        model = _MODEL_FILE.match(entry.name)
        optim = _OPTIM_FILE.match(entry.name)
        if model:
            if int(model.group(2)) != 0:
                raise CheckpointError(
                    f"{entry}: tensor-parallel checkpoints (mp_rank > 0) are not supported; export needs a pure "
                    "data-parallel ZeRO checkpoint"
                )
            rank = int(model.group(1) or 0)
            model_files[rank] = entry
        elif optim:
            if int(optim.group(3)) != 0:
                raise CheckpointError(f"{entry}: tensor-parallel checkpoints (mp_rank > 0) are not supported")
            optim_prefixes.add(optim.group(1) or "")
            optim_files[int(optim.group(2))] = entry
        elif entry.name.startswith("layer_") and entry.name.endswith("-model_states.pt"):
            raise CheckpointError(f"{entry}: pipeline-parallel checkpoints are not supported")
    if len(optim_prefixes) > 1:
        raise CheckpointError(
            f"{tag_dir} mixes optimizer files of different kinds "
            f"({', '.join(sorted(p or 'zero_' for p in optim_prefixes))}); "
            "the directory holds files from different runs"
        )
    return CheckpointFiles(tag_dir, tag, model_files, optim_files)
