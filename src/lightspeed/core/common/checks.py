"""Checks of the plain arguments a user passes (counts, dimensions, step numbers, module classes), shared by the
core's features."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

__all__ = ["module_class_problem", "module_class_problems", "require_whole_number"]


def require_whole_number(value: Any, minimum: int, message: str) -> int:
    """``value`` when it is an ``int`` of at least ``minimum``, else a ``ValueError`` with ``message`` (which names
    the argument and what it must be). ``True``/``False`` are refused although Python counts them as ints: a flag
    passed where a number belongs is a mistake, not 1 or 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(message)
    return value


def module_class_problem(entry: Any, whole_model: str) -> str | None:
    """What is wrong with ``entry`` where a ``torch.nn.Module`` subclass is expected, for a message listing the
    problems of several entries; None when it is one, and for other objects than modules and classes (the caller
    says what those should be). ``whole_model``: what ``torch.nn.Module`` itself would make of the whole model
    (``"one checkpoint"``)."""
    if isinstance(entry, nn.Module):
        return f"{entry!r} (a {type(entry).__name__} instance): pass its class, e.g. {type(entry).__name__}"
    if not isinstance(entry, type):
        return None
    if not issubclass(entry, nn.Module):
        return f"{entry.__qualname__} is not a torch.nn.Module subclass"
    if entry is nn.Module:
        return f"torch.nn.Module matches every module, so the whole model would be {whole_model}"
    return None


def module_class_problems(
    entries: Iterable[Any], whole_model: str, other_problem: Callable[[Any], str | None]
) -> tuple[list[Any], list[str]]:
    """The ``entries`` of a collection of module classes (a set in a stable order, for messages that do not change
    from run to run) and what is wrong with each: :func:`module_class_problem` for modules and classes,
    ``other_problem`` for anything else (None: an accepted entry)."""
    ordered = sorted(entries, key=repr) if isinstance(entries, (set, frozenset)) else list(entries)
    problems = []
    for entry in ordered:
        problem = module_class_problem(entry, whole_model)
        if problem is None and not isinstance(entry, type):
            problem = other_problem(entry)
        if problem is not None:
            problems.append(problem)
    return ordered, problems
