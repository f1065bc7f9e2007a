"""Lightning strategies: ZeRO (``ZeroStrategy``, ``ZeroAutoStrategy``), DDP and XLA with exact gradient
accumulation. :func:`register_trainer_strategies` registers the names users pass as ``Trainer(strategy=...)``
(``import lightspeed`` does, through :mod:`lightspeed.registry`)."""

from lightspeed.strategies.ddp_exact import DDPExactStrategy
from lightspeed.strategies.registration import register_trainer_strategies
from lightspeed.strategies.xla import SingleDeviceXLAExactStrategy, XLAExactStrategy
from lightspeed.strategies.zero import ZeroStrategy
from lightspeed.strategies.zero_auto import ZeroAutoStrategy

__all__ = [
    "DDPExactStrategy",
    "SingleDeviceXLAExactStrategy",
    "XLAExactStrategy",
    "ZeroAutoStrategy",
    "ZeroStrategy",
    "register_trainer_strategies",
]
