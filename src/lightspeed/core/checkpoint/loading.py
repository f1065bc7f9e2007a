"""Load a safetensors export (single file or sharded with an index) back into a module, restoring tied keys.

Keys and shapes are compared before any weight is touched, so a mismatch leaves the module unchanged. Tensors are
read one at a time from the memory-mapped shards and copied into the module's own tensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from lightspeed.core.checkpoint.plan import TIED_METADATA_KEY
from lightspeed.core.checkpoint.safetensors_writer import INDEX_FILE, SINGLE_FILE
from lightspeed.core.errors import ExportError

__all__ = ["LoadResult", "describe_key_mismatch", "export_files", "is_export", "load_exported", "read_exported"]


class LoadResult(NamedTuple):
    """Keys of the module that the export lacks, and keys of the export the module lacks (like ``load_state_dict``).

    Attributes:
        missing_keys: keys of the module that the export lacks.
        unexpected_keys: keys of the export that the module lacks.
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


def export_files(path: str | os.PathLike) -> tuple[dict[str, Path], dict[str, str]]:
    """``{key: file}`` for every stored tensor of an export, and its tied keys ``{alias: stored key}``."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        if (path / INDEX_FILE).is_file():
            path = path / INDEX_FILE
        elif (path / SINGLE_FILE).is_file():
            path = path / SINGLE_FILE
        else:
            raise ExportError(f"{path} holds no {SINGLE_FILE} or {INDEX_FILE}; it is not a safetensors export")
    if not path.is_file():
        raise ExportError(f"{path}: no such export")
    try:
        if path.name.endswith(".json"):
            index = json.loads(path.read_text())
            weight_map = {key: path.parent / name for key, name in index["weight_map"].items()}
            metadata = index.get("metadata") or {}
        else:
            with safe_open(str(path), framework="pt") as handle:
                weight_map = {key: path for key in handle.keys()}
                metadata = handle.metadata() or {}
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as error:
        raise ExportError(f"{path} is not a readable safetensors export ({error})") from None
    tied = metadata.get(TIED_METADATA_KEY)
    aliases = json.loads(tied) if isinstance(tied, str) else dict(tied or {})
    return weight_map, aliases


def is_export(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a safetensors export: a ``.safetensors`` file, or a directory holding one or an index."""
    path = Path(path)
    if path.is_dir():
        return (path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file()
    return path.suffix == ".safetensors" or path.name == INDEX_FILE


def read_exported(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every key of the export at ``path`` as a tensor, tied keys included (they name the same tensor)."""
    from safetensors import safe_open

    weight_map, aliases = export_files(path)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map.values())):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                tensors[key] = handle.get_tensor(key)
    for alias, owner in aliases.items():
        if owner in tensors:
            tensors[alias] = tensors[owner]
    return tensors


def describe_key_mismatch(
    missing: Sequence[str],
    unexpected: Sequence[str],
    labels: tuple[str, str],
    render: Callable[[Sequence[str]], str],
) -> str:
    """``"<label>: <keys>"`` for the missing, then the unexpected keys, each only when there are any, joined by
    ``"; "``: the one wording of a key mismatch between a module and stored weights (an export, a checkpoint), so the
    loaders only say what their keys are called and how a list of them is written."""
    groups = zip(labels, (missing, unexpected), strict=True)
    return "; ".join(f"{label}: {render(keys)}" for label, keys in groups if keys)


def load_exported(module: nn.Module, path: str | os.PathLike, strict: bool = True) -> LoadResult:
    """Copy the weights of the export at ``path`` into ``module`` (its ``state_dict()`` names).

    With ``strict`` every key of the module must be in the export and vice versa; otherwise the common keys are
    loaded. Shapes must always match. Raises :class:`ExportError` naming the keys, before changing anything.
    """
    from safetensors import safe_open

    weight_map, aliases = export_files(path)
    targets = {k: v for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
    available = set(weight_map) | {a for a, owner in aliases.items() if owner in weight_map}
    missing = [k for k in targets if k not in available]
    unexpected = sorted(k for k in available if k not in targets)
    if strict and (missing or unexpected):
        mismatch = describe_key_mismatch(
            missing,
            unexpected,
            ("missing keys (in the module, not in the export)", "unexpected keys (in the export, not in the module)"),
            str,
        )
        raise ExportError(
            f"the export at {path} does not match {type(module).__name__}: {mismatch}"
            " (pass strict=False to load the common keys only)"
        )
    handles: dict[Path, Any] = {}
    try:

        def handle_for(key: str) -> Any:
            file = weight_map[aliases.get(key, key)] if key not in weight_map else weight_map[key]
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt").__enter__()
            return handles[file]

        wrong_shapes = []
        for key, target in targets.items():
            if key in available:
                stored = key if key in weight_map else aliases[key]
                shape = tuple(handle_for(key).get_slice(stored).get_shape())
                if shape != tuple(target.shape):
                    wrong_shapes.append(f"{key}: export {shape}, module {tuple(target.shape)}")
        if wrong_shapes:
            raise ExportError(
                f"the export at {path} does not fit {type(module).__name__}: shapes differ for "
                + "; ".join(wrong_shapes)
            )
        with torch.no_grad():
            for key, target in targets.items():
                if key in available:
                    stored = key if key in weight_map else aliases[key]
                    target.copy_(handle_for(key).get_tensor(stored))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    return LoadResult(missing, unexpected)
