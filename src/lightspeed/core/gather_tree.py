"""Flatten nested gather inputs into leaves and rebuild them, keeping dicts dicts and tuples tuples.

Leaf kinds:

* ``tensor``: a tensor with at least one dimension; dim 0 is the sample dimension.
* ``scalar``: a 0-d tensor: one value per rank, not a sample.
* ``objects``: a list or tuple with no tensor inside: one Python object per sample (e.g. strings).
* ``object``: anything else (a number, a string, None): one object per rank.

A list or tuple that holds a tensor somewhere is a container and is walked into; dicts always are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch


@dataclass
class Leaf:
    path: str
    kind: str  # "tensor" | "scalar" | "objects" | "object"
    value: Any

    @property
    def rows(self) -> int | None:
        """Number of samples in the leaf (``None`` for per-rank values)."""
        if self.kind == "tensor":
            return int(self.value.shape[0])
        if self.kind == "objects":
            return len(self.value)
        return None

    def describe(self) -> str:
        """One line for cross-rank structure checks: path, kind, dtype, number of dims."""
        if self.kind in ("tensor", "scalar"):
            return f"{self.path}: tensor {str(self.value.dtype).replace('torch.', '')} with {self.value.ndim} dims"
        if self.kind == "objects":
            return f"{self.path}: {type(self.value).__name__} of per-sample objects"
        return f"{self.path}: object"


def contains_tensor(data: Any) -> bool:
    """Whether a tensor appears anywhere inside ``data``."""
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, Mapping):
        return any(contains_tensor(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return any(contains_tensor(v) for v in data)
    return False


def flatten(data: Any, path: str = "data") -> tuple[list[Leaf], Callable[[list[Any]], Any]]:
    """Leaves of ``data`` in a fixed order and a function that rebuilds the structure from new leaf values."""
    if isinstance(data, torch.Tensor):
        leaf = Leaf(path, "scalar" if data.ndim == 0 else "tensor", data)
        return [leaf], lambda values: values[0]
    if isinstance(data, Mapping):
        keys = list(data.keys())
        parts = [flatten(data[k], f"{path}[{k!r}]") for k in keys]
        leaves = [leaf for part, _ in parts for leaf in part]
        counts = [len(part) for part, _ in parts]

        def rebuild_mapping(values: list[Any]) -> Any:
            items, offset = [], 0
            for key, count, (_, rebuild) in zip(keys, counts, parts):
                items.append((key, rebuild(values[offset:offset + count])))
                offset += count
            try:
                return type(data)(items)
            except TypeError:
                return dict(items)

        return leaves, rebuild_mapping
    if isinstance(data, (list, tuple)) and contains_tensor(data):
        parts = [flatten(v, f"{path}[{i}]") for i, v in enumerate(data)]
        leaves = [leaf for part, _ in parts for leaf in part]
        counts = [len(part) for part, _ in parts]

        def rebuild_sequence(values: list[Any]) -> Any:
            items, offset = [], 0
            for count, (_, rebuild) in zip(counts, parts):
                items.append(rebuild(values[offset:offset + count]))
                offset += count
            if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
                return type(data)(*items)
            return type(data)(items)

        return leaves, rebuild_sequence
    if isinstance(data, (list, tuple)):
        return [Leaf(path, "objects", data)], lambda values: values[0]
    return [Leaf(path, "object", data)], lambda values: values[0]
