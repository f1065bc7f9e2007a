"""How many samples a batch (or one output of a step) holds: the single rule every part of lightspeed uses."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["count_samples"]


def count_samples(batch: Any) -> int | None:
    """Samples in ``batch``: depth first through mappings, lists, tuples and dataclasses, the first count found,
    where a tensor counts its leading dimension; a list or tuple none of whose items is a container counts its
    length (one object per sample, e.g. a list of strings). So a collated ``(list_of_str, list_of_str)`` batch
    counts the inner length, and ``[["a", "b", "c"], ["d"]]`` counts 3.

    Returns ``None`` when nothing in ``batch`` has a sample dimension (a 0-d tensor, a plain number or string, a
    mapping of those).
    """
    if isinstance(batch, torch.Tensor):
        if batch.is_nested:  # a nested tensor has no shape, but its components are its samples
            return int(batch.size(0))
        return int(batch.shape[0]) if batch.ndim > 0 else None
    if isinstance(batch, Mapping):
        children: Iterable[Any] = batch.values()
    elif isinstance(batch, (list, tuple)):
        children = batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        children = (getattr(batch, field.name) for field in dataclasses.fields(batch))
    else:
        return None
    for child in children:
        found = count_samples(child)
        if found is not None:
            return found
    if isinstance(batch, (list, tuple)) and not any(_is_container(item) for item in batch):
        return len(batch)
    return None


def _is_container(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, Mapping, list, tuple)) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    )
