"""Lightning callbacks: ``GatherForMetrics`` (exact distributed metrics) and ``ZeroExport`` (safetensors export)."""

from __future__ import annotations

from lightspeed._lazy import lazy_getattr

_LAZY = {
    "GatherForMetrics": "lightspeed.callbacks.gather_for_metrics",
    "ZeroExport": "lightspeed.callbacks.zero_export",
    "StepOutputError": "lightspeed.callbacks.gather_for_metrics",
}
__all__ = list(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)
