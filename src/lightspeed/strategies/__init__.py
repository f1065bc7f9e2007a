"""Lightning strategies: ZeRO (``ZeroStrategy``, ``ZeroAutoStrategy``), DDP and XLA with exact gradient
accumulation. :func:`lightspeed.strategies.registration.register_trainer_strategies` registers the names users pass
as ``Trainer(strategy=...)`` (``import lightspeed`` does, through :mod:`lightspeed.registry`);
``lightspeed.strategies.register_trainer_strategies`` still works, deprecated (a ``FutureWarning``)."""

from typing import TYPE_CHECKING

from lightspeed.core.common import deprecation as _deprecation
from lightspeed.strategies import registration as _registration
from lightspeed.strategies.ddp_exact import DDPExactStrategy
from lightspeed.strategies.xla import SingleDeviceXLAExactStrategy, XLAExactStrategy
from lightspeed.strategies.zero import ZeroStrategy
from lightspeed.strategies.zero_auto import ZeroAutoStrategy

__all__ = [
    "DDPExactStrategy",
    "SingleDeviceXLAExactStrategy",
    "XLAExactStrategy",
    "ZeroAutoStrategy",
    "ZeroStrategy",
]

#: names once public here, still reachable with a FutureWarning: old name -> (new spelling, object)
_MOVED = {"register_trainer_strategies": _deprecation.moved_registration(_registration.register_trainer_strategies)}

if not TYPE_CHECKING:  # type checkers report the old names as missing; at run time they still work
    __getattr__ = _deprecation.module_getattr(__name__, _MOVED)
