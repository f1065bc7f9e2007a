"""Lightning plugins: precision (``plugins/precision``) and accelerators (``plugins/accelerators``).

``from lightspeed.plugins import XLAPrecision`` works; the plugin modules load on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it
_LAZY = {
    "XLAPrecision": "lightspeed.plugins.precision.xla",
    "XLAAccelerator": "lightspeed.plugins.accelerators.xla",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightspeed.plugins' has no attribute {name!r}")
