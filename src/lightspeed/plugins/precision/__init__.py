"""Lightning precision plugins. Names load on first access so that ``import lightspeed`` stays light."""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it
_LAZY = {
    "XLAPrecision": "lightspeed.plugins.precision.xla",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightspeed.plugins.precision' has no attribute {name!r}")
