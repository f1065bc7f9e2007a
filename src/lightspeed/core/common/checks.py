"""Checks of the plain arguments a user passes (counts, dimensions, step numbers), shared by the core's features."""

from __future__ import annotations

from typing import Any

__all__ = ["require_whole_number"]


def require_whole_number(value: Any, minimum: int, message: str) -> int:
    """``value`` when it is an ``int`` of at least ``minimum``, else a ``ValueError`` with ``message`` (which names
    the argument and what it must be). ``True``/``False`` are refused although Python counts them as ints: a flag
    passed where a number belongs is a mistake, not 1 or 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(message)
    return value
