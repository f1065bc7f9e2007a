"""Lightning callbacks: ``GatherForMetrics`` (exact distributed metrics) and ``ZeroExport`` (safetensors export)."""

from lightspeed.callbacks.gather_for_metrics import GatherForMetrics
from lightspeed.callbacks.zero_export import ZeroExport
from lightspeed.core.errors import StepOutputError

__all__ = ["GatherForMetrics", "StepOutputError", "ZeroExport"]
