"""Lightning callbacks: ``GatherForMetrics`` (exact distributed metrics) and ``ZeroExport`` (safetensors export)."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "GatherForMetrics": "lightspeed.callbacks.gather_for_metrics",
    "ZeroExport": "lightspeed.callbacks.zero_export",
}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightspeed.callbacks' has no attribute {name!r}")
