"""Lightning callbacks: ``GatherForMetrics`` (exact distributed metrics) and ``ZeroExport`` (safetensors export)."""

from lightspeed.callbacks.gather_for_metrics import GatherForMetrics, StepOutputError
from lightspeed.callbacks.zero_export import ZeroExport

__all__ = ["GatherForMetrics", "StepOutputError", "ZeroExport"]
