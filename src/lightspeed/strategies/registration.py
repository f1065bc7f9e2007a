"""lightspeed's strategy names in the Trainer's registry (``Trainer(strategy="zero3_offload")``); the sibling of
:mod:`lightspeed.fabric.registration`."""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightspeed.core.zero.config import zero_registrations
from lightspeed.strategies.ddp_exact import DDPExactStrategy
from lightspeed.strategies.xla import SingleDeviceXLAExactStrategy, XLAExactStrategy
from lightspeed.strategies.zero import ZeroStrategy
from lightspeed.strategies.zero_auto import ZeroAutoStrategy

__all__ = ["register_trainer_strategies"]


def register_trainer_strategies() -> None:
    """Register ``zero1`` ... ``zero3_nvme``, ``zero_auto``, ``ddp_exact``, ``xla_exact`` and ``single_xla_exact``
    with the Trainer (idempotent)."""
    for name, strategy, description, params in zero_registrations(ZeroStrategy, ZeroAutoStrategy):
        StrategyRegistry.register(name, strategy, description=description, override=True, **params)
    StrategyRegistry.register(
        "ddp_exact",
        DDPExactStrategy,
        description="DDP with exact gradient accumulation (short last window, item weighting, no_sync)",
        override=True,
        start_method="popen",
    )
    StrategyRegistry.register(
        "xla_exact",
        XLAExactStrategy,
        description="XLA on all PJRT devices with exact gradient accumulation and casting XLAPrecision",
        override=True,
    )
    StrategyRegistry.register(
        "single_xla_exact",
        SingleDeviceXLAExactStrategy,
        description="One XLA device with exact gradient accumulation and casting XLAPrecision",
        override=True,
    )
