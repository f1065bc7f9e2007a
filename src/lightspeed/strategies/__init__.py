"""Lightning strategies: ZeRO (``ZeroStrategy``, ``ZeroAutoStrategy``), DDP and XLA with exact gradient
accumulation. The names users pass as ``Trainer(strategy=...)`` are registered by :mod:`lightspeed.registry`."""

from lightspeed.strategies.ddp_exact import DDPExactStrategy
from lightspeed.strategies.xla import SingleDeviceXLAExactStrategy, XLAExactStrategy
from lightspeed.strategies.zero import ZeroStrategy
from lightspeed.strategies.zero_auto import ZeroAutoStrategy

__all__ = ["DDPExactStrategy", "SingleDeviceXLAExactStrategy", "XLAExactStrategy", "ZeroAutoStrategy", "ZeroStrategy"]
