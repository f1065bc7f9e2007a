"""lightspeed's strategy names in Lightning Fabric's registry (``Fabric(strategy="zero3_offload")``)."""

from __future__ import annotations

from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightspeed.core.zero.config import ZERO_PRESETS
from lightspeed.fabric.ddp_exact import DDPExactFabricStrategy
from lightspeed.fabric.zero import ZeroFabricStrategy
from lightspeed.fabric.zero_auto import ZeroAutoFabricStrategy

__all__ = ["register_fabric_strategies"]


def register_fabric_strategies() -> None:
    """Register ``zero1`` ... ``zero3_nvme``, ``zero_auto`` and ``ddp_exact`` with Fabric (idempotent)."""
    for name, preset in ZERO_PRESETS.items():
        STRATEGY_REGISTRY.register(
            name, ZeroFabricStrategy, description=preset.description, override=True, **preset.init_params()
        )
    STRATEGY_REGISTRY.register(
        "zero_auto",
        ZeroAutoFabricStrategy,
        description="ZeRO with the fastest stage/offload that fits the model in this machine's memory",
        override=True,
    )
    STRATEGY_REGISTRY.register(
        "ddp_exact",
        DDPExactFabricStrategy,
        description="DDP for lightspeed.fabric.accumulate: exact accumulation (short last window, item weighting, "
        "no_sync)",
        override=True,
        start_method="popen",
    )
