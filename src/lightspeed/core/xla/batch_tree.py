"""Walk the tensors of a batch (nested mappings, lists, tuples, named tuples and dataclasses) with their paths, and
rebuild a batch with some tensors replaced, keeping every container's type. What the padding helper and the
recompilation alarm share.

A path is the tuple of keys, indices and dataclass fields from the batch down to a tensor; :func:`format_path`
writes it as Python would (``batch['input_ids']``, ``batch[0]``, ``batch.tokens``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import Tensor

__all__ = ["Field", "Path", "format_path", "leaf_name", "map_tensors", "tensor_leaves"]


class Field(str):
    """A dataclass field in a path (written ``.name``; a mapping key is written ``['name']``)."""


Path = tuple[Any, ...]


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _children(batch: Any) -> list[tuple[Any, Any]] | None:
    """(path element, child) of a container, or ``None`` for anything that is not one."""
    if isinstance(batch, Mapping):
        return list(batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple: its fields have names
        return [(Field(name), value) for name, value in zip(batch._fields, batch, strict=True)]
    if isinstance(batch, (list, tuple)):
        return list(enumerate(batch))
    if _is_dataclass_instance(batch):
        return [(Field(f.name), getattr(batch, f.name)) for f in dataclasses.fields(batch)]
    return None


def tensor_leaves(batch: Any, path: Path = ()) -> Iterator[tuple[Path, Tensor]]:
    """Every tensor of ``batch`` with its path, depth first in the containers' order."""
    if isinstance(batch, Tensor):
        yield path, batch
        return
    for key, child in _children(batch) or ():
        yield from tensor_leaves(child, (*path, key))


def _rebuild(batch: Any, items: list[tuple[Any, Any]]) -> Any:
    if isinstance(batch, Mapping):
        values = dict(items)
        mapping_type: Any = type(batch)
        try:
            return mapping_type(values)  # dict, OrderedDict, a tokenizer's BatchEncoding, ...
        except TypeError:
            return values
    if isinstance(batch, tuple):
        values_list = [value for _, value in items]
        if hasattr(batch, "_fields"):  # a named tuple
            return type(batch)(*values_list)
        return type(batch)(values_list) if type(batch) is not tuple else tuple(values_list)
    if isinstance(batch, list):
        return [value for _, value in items]
    changes = {str(key): value for key, value in items if getattr(batch, str(key)) is not value}
    return dataclasses.replace(batch, **changes) if changes else batch


def map_tensors(batch: Any, function: Callable[[Path, Tensor], Any], path: Path = ()) -> Any:
    """``batch`` with every tensor replaced by ``function(path, tensor)``; containers are rebuilt with their type,
    everything else is kept as it is."""
    if isinstance(batch, Tensor):
        return function(path, batch)
    children = _children(batch)
    if children is None:
        return batch
    return _rebuild(batch, [(key, map_tensors(child, function, (*path, key))) for key, child in children])


def format_path(path: Path, root: str = "batch") -> str:
    """``batch['input_ids']``, ``batch[0]['x']``, ``batch.tokens``; the root alone for the batch itself."""
    text = root
    for key in path:
        text += f".{key}" if isinstance(key, Field) else f"[{key!r}]"
    return text


def leaf_name(path: Path) -> Any:
    """The key, index or field name a tensor has in its innermost container (``None`` for the batch itself)."""
    if not path:
        return None
    key = path[-1]
    return str(key) if isinstance(key, Field) else key
