"""Module attributes that import their defining module on first access, so ``import lightspeed`` stays light
(no DeepSpeed, no torch_xla) until a feature is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """Build a module-level ``__getattr__`` that resolves ``name`` from the module ``names[name]``."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
