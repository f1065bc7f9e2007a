"""Find the files of a DeepSpeed checkpoint: the tag directory and the model/optimizer file of every rank.

Accepted inputs: the directory DeepSpeed's ``save_checkpoint`` wrote into (a ``latest`` file naming the tag, one
sub-directory per tag; Lightning's ``<name>.ckpt/`` directories look exactly like this with the tag
``checkpoint``), or a tag directory itself.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from lightspeed.core.checkpoint.errors import CheckpointError

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

    def offload_dir(self, rank: int) -> Path | None:
        """The folder DeepSpeed copies a rank's NVMe swap files into when it saves, if there is one."""
        for name in (f"rank{rank:02d}", f"rank{rank}"):
            candidate = self.tag_dir / "offloaded_tensors" / name
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
    raise CheckpointError(
        f"{path} is not a DeepSpeed checkpoint: it has neither a 'latest' file nor a tag directory holding "
        "'*_model_states.pt' files"
    )


def locate(checkpoint: str | os.PathLike, tag: str | None = None) -> CheckpointFiles:
    """Find the tag directory and the per-rank files; refuse tensor/pipeline-parallel and mixed layouts."""
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
