"""Pretrained weights from a HuggingFace-layout directory into a plain ``nn.Module``, straight into its ZeRO-3
partitions.

``transformers`` models load themselves into partitions (:mod:`lightspeed.core.zero.hf_link`); any other module gets
:func:`load_pretrained`: the directory's ``model.safetensors`` or sharded ``model.safetensors.index.json`` (what
``save_pretrained`` and lightspeed's export write) is checked against the module from the files' headers alone
(missing or extra tensors, other shapes: one error naming them, raised on every rank before anything is read), then
copied one tensor at a time. A ZeRO-3 partitioned parameter is gathered, filled by rank 0 (the only rank that reads
it from the files) and partitioned again, so no rank holds more than its partition plus one whole tensor.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from lightspeed.core.checkpoint.loading import LoadResult, export_files
from lightspeed.core.common.distributed import global_rank, raise_on_every_rank
from lightspeed.core.errors import CheckpointError, ExportError
from lightspeed.core.zero.weights import load_tensors

__all__ = ["load_pretrained"]


class _SafetensorsFiles:
    """The safetensors files of one directory, read one tensor at a time. Each read opens its file and closes it
    again, so the file's pages are not kept mapped into the process (they would count as its resident memory)."""

    def __init__(self, weight_map: dict[str, Path]) -> None:
        self.weight_map = weight_map

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, from the files' headers (no tensor data is read)."""
        from safetensors import safe_open

        shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.weight_map.values())):
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    if self.weight_map.get(key) == file:
                        shapes[key] = tuple(handle.get_slice(key).get_shape())
        missing = sorted(set(self.weight_map) - set(shapes))
        for key in missing:  # an alias of a tied tensor (lightspeed exports) or a key the index names wrongly
            with safe_open(str(self.weight_map[key]), framework="pt") as handle:
                shapes[key] = tuple(handle.get_slice(key).get_shape())
        return shapes

    def read(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.weight_map[key]), framework="pt") as handle:
            return handle.get_tensor(key)  # safetensors copies the bytes out of the mapping


def _files_of(path: Path) -> _SafetensorsFiles:
    try:
        weight_map, aliases = export_files(path)
    except ExportError as error:
        raise CheckpointError(
            f"{path} is not a pretrained directory lightspeed can read: it needs model.safetensors or a sharded "
            f"model.safetensors.index.json (as `save_pretrained` and `lightspeed export` write them). ({error})"
        ) from None
    for alias, owner in aliases.items():  # a lightspeed export names each tied tensor once, with its aliases
        if owner in weight_map:
            weight_map.setdefault(alias, weight_map[owner])
    return _SafetensorsFiles(weight_map)


def load_pretrained(
    module: torch.nn.Module, path: str | os.PathLike[str], *, strict: bool = True, optimizer: object | None = None
) -> LoadResult:
    """Load the pretrained weights in directory ``path`` into ``module``, which may be partitioned by ZeRO-3 (built
    under ``configure_model`` / ``fabric.init_module()``); returns the module keys the files lack and the file keys the
    module lacks (both empty with ``strict``, which refuses them).

    A collective when several processes run: every rank calls it. ``optimizer``: the ZeRO optimizer of an engine that
    already exists, whose fp32 master copies are refreshed afterwards.

    Args:
        module: the module to load into, whole or partitioned by ZeRO-3.
        path: a directory with ``model.safetensors`` or a sharded ``model.safetensors.index.json``.
        strict: refuse module keys the files lack and file keys the module lacks (``False``: load the matching
            tensors and return what was skipped).
        optimizer: the ZeRO optimizer of an engine that already exists, whose fp32 master copies are refreshed.
    """
    path = Path(path)
    files: _SafetensorsFiles | None = None
    shapes: dict[str, tuple[int, ...]] = {}
    error: Exception | None = None
    try:
        files = _files_of(path)
        shapes = files.shapes()
    except Exception as err:  # noqa: BLE001 - unreadable files: reported on every rank below
        error = err if isinstance(err, CheckpointError) else CheckpointError(f"{path}: {err}")
    raise_on_every_rank(error, f"Reading {path}", error_type=CheckpointError)
    assert files is not None
    missing, unexpected = load_tensors(
        module,
        shapes,
        files.read,
        rank=global_rank(),
        optimizer=optimizer,
        strict=strict,
        source=f"pretrained directory {str(path)!r}",
    )
    return LoadResult(missing, unexpected)
