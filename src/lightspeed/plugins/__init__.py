"""Lightning plugins: precision (``plugins/precision``) and accelerators (``plugins/accelerators``).

``from lightspeed.plugins import XLAPrecision`` works; the plugin modules load on first access.
"""

from __future__ import annotations

from lightspeed._lazy import lazy_getattr

_LAZY = {
    "XLAPrecision": "lightspeed.plugins.precision.xla",
    "XLAAccelerator": "lightspeed.plugins.accelerators.xla",
}
__all__ = list(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)
