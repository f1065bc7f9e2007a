"""Flatten nested gather inputs into leaves and rebuild them, keeping dicts dicts and tuples tuples.

Leaf kinds:

* ``tensor``: a tensor with at least one dimension; dim 0 is the sample dimension.
* ``scalar``: a 0-d tensor: one value per rank, not a sample.
* ``objects``: a list or tuple with no tensor inside: one Python object per sample (e.g. strings).
* ``object``: anything else (a number, a string, None): one object per rank.
* ``nested``: a nested tensor (``torch.nested``): it has no regular shape, so the gathers reject it with
  :func:`nested_problem` (on every rank, through the collective's error flag).

A list or tuple that holds a tensor somewhere is a container and is walked into; dicts always are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lightspeed.core.common.batch import count_samples

LeafKind = Literal["tensor", "scalar", "objects", "object", "nested"]
Rebuild = Callable[[list[Any]], Any]


@dataclass
class Leaf:
    """One value of a gather's input, with its path (for messages) and kind (see the module docstring)."""

    path: str
    kind: LeafKind
    value: Any

    @property
    def rows(self) -> int | None:
        """Number of samples in the leaf (``None`` for per-rank values).

        A tensor's samples are counted by ``count_samples``; an ``objects`` leaf holds one object per sample by
        definition, whatever the objects are (lists of tokens, dicts), so its samples are its items.
        """
        if self.kind == "tensor":
            return count_samples(self.value)
        if self.kind == "objects":
            return len(self.value)
        return None

    def describe(self) -> str:
        """One line for cross-rank structure checks: path, kind, dtype, number of dims."""
        if self.kind == "nested":
            return f"{self.path}: nested tensor {str(self.value.dtype).replace('torch.', '')}"
        if self.kind in ("tensor", "scalar"):
            return f"{self.path}: tensor {str(self.value.dtype).replace('torch.', '')} with {self.value.ndim} dims"
        if self.kind == "objects":
            return f"{self.path}: {type(self.value).__name__} of per-sample objects"
        return f"{self.path}: object"


def as_leaf(value: Any, path: str = "data") -> Leaf:
    """``value`` taken as one leaf, without walking into it: a tensor, a sequence of per-sample objects or an object.

    :func:`flatten` makes its leaves with it; code that handles single outputs (a window of step outputs) counts
    their samples through it, so that it counts exactly as the gather does.
    """
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return Leaf(path, "nested", value)
        return Leaf(path, "scalar" if value.ndim == 0 else "tensor", value)
    if isinstance(value, (list, tuple)):
        return Leaf(path, "objects", value)
    return Leaf(path, "object", value)


def nested_problem(function: str, leaves: list[Leaf]) -> str | None:
    """The error for the first nested tensor among ``leaves`` (None when there is none)."""
    leaf = next((leaf for leaf in leaves if leaf.kind == "nested"), None)
    if leaf is None:
        return None
    if function == "pad_across_processes":
        fix = (
            "convert it first with .to_padded_tensor(pad_value) (it pads within this rank), then pad the result "
            "across ranks with pad_across_processes"
        )
    else:
        fix = (
            "convert it with .to_padded_tensor(pad_value) (then lightspeed.pad_across_processes(..., dim=1) if the "
            "lengths differ across ranks), or pass per-sample Python lists: [t.tolist() for t in x.unbind()]"
        )
    return f"{function} got a nested tensor at {leaf.path}; nested tensors have no regular shape to gather: {fix}."


def contains_tensor(data: Any) -> bool:
    """Whether a tensor appears anywhere inside ``data``."""
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, Mapping):
        return any(contains_tensor(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return any(contains_tensor(v) for v in data)
    return False


def flatten(data: Any, path: str = "data") -> tuple[list[Leaf], Rebuild]:
    """Leaves of ``data`` in a fixed order and a function that rebuilds the structure from new leaf values."""
    if isinstance(data, Mapping):
        keys = list(data.keys())
        leaves, rebuild_values = _flatten_children([data[k] for k in keys], [f"{path}[{k!r}]" for k in keys])

        def rebuild_mapping(values: list[Any]) -> Any:
            items = list(zip(keys, rebuild_values(values), strict=True))
            mapping_type: Any = type(data)
            try:
                return mapping_type(items)
            except TypeError:
                return dict(items)

        return leaves, rebuild_mapping
    if isinstance(data, (list, tuple)) and contains_tensor(data):
        leaves, rebuild_values = _flatten_children(list(data), [f"{path}[{i}]" for i in range(len(data))])

        def rebuild_sequence(values: list[Any]) -> Any:
            items = rebuild_values(values)
            if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
                return type(data)(*items)
            return type(data)(items)

        return leaves, rebuild_sequence
    return [as_leaf(data, path)], lambda values: values[0]


def _flatten_children(children: list[Any], paths: list[str]) -> tuple[list[Leaf], Callable[[list[Any]], list[Any]]]:
    """Leaves of several children in order, and a function from their new leaf values to the rebuilt children."""
    parts = [flatten(child, child_path) for child, child_path in zip(children, paths, strict=True)]
    leaves = [leaf for part, _ in parts for leaf in part]
    counts = [len(part) for part, _ in parts]

    def rebuild_children(values: list[Any]) -> list[Any]:
        items, offset = [], 0
        for count, (_, rebuild) in zip(counts, parts, strict=True):
            items.append(rebuild(values[offset : offset + count]))
            offset += count
        return items

    return leaves, rebuild_children


__all__ = ["Leaf", "LeafKind", "Rebuild", "as_leaf", "contains_tensor", "flatten", "nested_problem"]
