"""Lightning callbacks: ``GatherForMetrics`` (exact distributed metrics) and ``ZeroExport`` (safetensors export).

``StepOutputError`` is public in :mod:`lightspeed.errors`; ``lightspeed.callbacks.StepOutputError`` still works,
deprecated (a ``FutureWarning``)."""

from typing import TYPE_CHECKING

from lightspeed.callbacks.gather_for_metrics import GatherForMetrics
from lightspeed.callbacks.zero_export import ZeroExport
from lightspeed.core import errors as _errors
from lightspeed.core.common import deprecation as _deprecation

__all__ = ["GatherForMetrics", "ZeroExport"]

#: names once public here, still reachable with a FutureWarning: old name -> (new spelling, object)
_MOVED = {"StepOutputError": ("lightspeed.errors.StepOutputError", _errors.StepOutputError)}

if not TYPE_CHECKING:  # type checkers report the old names as missing; at run time they still work

    def __getattr__(name: str) -> object:
        return _deprecation.moved_attribute(__name__, name, _MOVED)
