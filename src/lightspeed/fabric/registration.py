"""lightspeed's strategy names in Lightning Fabric's registry (``Fabric(strategy="zero3_offload")``)."""

from __future__ import annotations

from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightspeed.core.zero.config import zero_registrations
from lightspeed.fabric.ddp_exact import DDPExactFabricStrategy
from lightspeed.fabric.zero import ZeroFabricStrategy
from lightspeed.fabric.zero_auto import ZeroAutoFabricStrategy

__all__ = ["register_fabric_strategies"]


def register_fabric_strategies() -> None:
    """Register ``zero1`` ... ``zero3_nvme``, ``zero_auto`` and ``ddp_exact`` with Fabric (idempotent)."""
    for name, strategy, description, params in zero_registrations(ZeroFabricStrategy, ZeroAutoFabricStrategy):
        STRATEGY_REGISTRY.register(name, strategy, description=description, override=True, **params)
    STRATEGY_REGISTRY.register(
        "ddp_exact",
        DDPExactFabricStrategy,
        description="DDP for lightspeed.fabric.accumulate: exact accumulation (short last window, item weighting, "
        "no_sync)",
        override=True,
        start_method="popen",
    )
