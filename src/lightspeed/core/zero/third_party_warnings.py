"""The third-party warnings a ZeRO run would otherwise print by the hundred, filtered while the strategy runs.

Each entry matches one message, one category and the module the warning is attributed to; nothing else is
silenced (never lightspeed's own warnings, never a whole category). :func:`install` adds the filters when a ZeRO
strategy sets up its processes and :func:`uninstall` removes exactly those filters again in its teardown.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, cast

__all__ = ["THIRD_PARTY_WARNINGS", "install", "uninstall"]


@dataclass(frozen=True)
class IgnoredWarning:
    message: str  # regular expression matched against the start of the message
    category: type[Warning]
    module: str  # regular expression matched against the module the warning is attributed to


THIRD_PARTY_WARNINGS: tuple[IgnoredWarning, ...] = (
    # DeepSpeed's ZeRO communication (deepspeed/comm/torch.py) calls torch.distributed.all_gather_into_tensor and
    # reduce_scatter_tensor on every bucket, which torch 2.13 deprecates in favour of *_single. The call is inside
    # DeepSpeed; torch's deprecation wrapper (torch.distributed.c10d_logger) is the frame the warning names, and it
    # fires once per call site and rank: about a thousand lines in the README's example.
    IgnoredWarning(
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        FutureWarning,
        r"torch\.distributed\.c10d_logger",
    ),
    # Lightning's own pytree helper (lightning/pytorch/utilities/_pytree.py) builds torch's LeafSpec, deprecated in
    # torch 2.13; it runs on every batch transfer and every logged value. Only a Lightning release can change it.
    IgnoredWarning(
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        FutureWarning,
        r"lightning\.pytorch\.utilities\._pytree",
    ),
)


def _filters() -> list[Any]:
    return cast(list[Any], warnings.filters)  # a plain list, typed as a Sequence


def _filter_tuples() -> list[tuple]:
    """The entries as ``warnings.filters`` stores them (compiled patterns), to find them again for removal."""
    with warnings.catch_warnings():  # restores the real filters on exit
        warnings.resetwarnings()
        for entry in THIRD_PARTY_WARNINGS:
            warnings.filterwarnings("ignore", message=entry.message, category=entry.category, module=entry.module)
        return list(warnings.filters)


def install() -> None:
    """Add the filters (once; installing again while they are in place changes nothing)."""
    for entry in THIRD_PARTY_WARNINGS:
        warnings.filterwarnings("ignore", message=entry.message, category=entry.category, module=entry.module)


def uninstall() -> None:
    """Remove the filters :func:`install` added, leaving every other filter as it is."""
    ours = _filter_tuples()
    remaining = [f for f in warnings.filters if f not in ours]
    if len(remaining) != len(warnings.filters):
        _filters()[:] = remaining
        warnings._filters_mutated()  # type: ignore[attr-defined]
