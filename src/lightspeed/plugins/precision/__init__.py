"""Lightning precision plugins. Names load on first access so that ``import lightspeed`` stays light."""

from __future__ import annotations

from lightspeed._lazy import lazy_getattr

_LAZY = {"XLAPrecision": "lightspeed.plugins.precision.xla"}
__all__ = list(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)
