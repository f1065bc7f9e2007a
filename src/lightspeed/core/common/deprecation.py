"""Old spellings that keep working: a name that moved out of a public module, or a keyword that was renamed, still
does what it did, after a ``FutureWarning`` that names the new spelling (the warning points at the user's line).

A public module keeps a moved name reachable with a module ``__getattr__``::

    _MOVED = {"GatherError": ("lightspeed.errors.GatherError", errors.GatherError)}

    def __getattr__(name: str) -> Any:
        return moved_attribute(__name__, name, _MOVED)

(the exception classes renamed in :mod:`lightspeed.core.errors` keep their old names there, with the same warning).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = ["moved_attribute", "renamed_keyword", "warn_deprecated"]

T = TypeVar("T")


def warn_deprecated(old: str, new: str, *, stacklevel: int = 1) -> None:
    """A ``FutureWarning``: ``old`` is deprecated, use ``new``. ``stacklevel`` counts from the caller (1: the line
    that called this function; 2: the line that called that function, the usual case)."""
    warnings.warn(
        f"{old} is deprecated and will be removed; use {new} instead.", FutureWarning, stacklevel=stacklevel + 1
    )


def moved_attribute(module: str, name: str, moved: Mapping[str, tuple[str, Any]]) -> Any:
    """For the module ``__getattr__`` of ``module``: the object the old name ``name`` still reaches (``moved``: old
    name -> (its new spelling, the object)), after a ``FutureWarning`` naming the new spelling; ``AttributeError``
    for any other name, as for a module without ``__getattr__``."""
    if name not in moved:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new, value = moved[name]
    warn_deprecated(f"{module}.{name}", new, stacklevel=3)  # this function, the module's __getattr__, the user
    return value


def module_getattr(module: str, moved: Mapping[str, tuple[str, Any]]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``module`` whose old names (``moved``: old name -> (its new spelling, the object)) still
    reach their objects, with a :func:`moved_attribute` warning."""

    def __getattr__(name: str) -> Any:
        return moved_attribute(module, name, moved)

    return __getattr__


def moved_registration(register: Callable[..., Any]) -> tuple[str, Any]:
    """The ``moved`` entry of a front end's ``register_*_strategies`` once public in its package: its new spelling
    (the registration module's) and what to do instead."""
    spelling = f"{register.__module__}.{register.__qualname__}"
    advice = "`import lightspeed` already calls it; lightspeed.registry.register_all() registers everything again"
    return f"{spelling} ({advice})", register


def renamed_keyword(owner: str, old: str, new: str, old_value: T | None, new_value: T, default: T, depth: int = 1) -> T:
    """The value of the keyword ``new`` of ``owner`` (a function or class, as users write it) whose old name was
    ``old``: ``old_value`` (None when the caller did not pass ``old``) wins, after a ``FutureWarning`` pointing at the
    caller of ``owner`` (``depth``: the calls between ``owner`` and this function, itself included); passing both
    with different values is a ``TypeError``."""
    if old_value is None:
        return new_value
    warn_deprecated(f"{owner}({old}=...)", f"{new}=...", stacklevel=2 + depth)  # this function, owner, the user
    if new_value != default and new_value != old_value:
        raise TypeError(
            f"{owner} got {new}={new_value!r} and its deprecated name {old}={old_value!r}; pass {new} only."
        )
    return old_value
