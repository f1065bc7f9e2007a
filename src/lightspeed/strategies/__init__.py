"""Lightning strategies. ``register_strategies`` adds every lightspeed name to Lightning's StrategyRegistry."""

from __future__ import annotations

import importlib

from lightspeed._lazy import lazy_getattr

# Each module listed here defines ``register(registry)``; add a line when a new strategy module lands.
_STRATEGY_MODULES = (
    "lightspeed.strategies.zero",
    "lightspeed.strategies.ddp_exact",
    "lightspeed.strategies.xla",
    "lightspeed.strategies.zero_auto",
)


def register_strategies() -> None:
    """Register all lightspeed strategy names (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    for module_name in _STRATEGY_MODULES:
        importlib.import_module(module_name).register(StrategyRegistry)


_LAZY = {
    "ZeroStrategy": "lightspeed.strategies.zero",
    "ZeroAutoStrategy": "lightspeed.strategies.zero_auto",
    "DDPExactStrategy": "lightspeed.strategies.ddp_exact",
    "XLAExactStrategy": "lightspeed.strategies.xla",
    "SingleDeviceXLAExactStrategy": "lightspeed.strategies.xla",
}
__all__ = ["register_strategies", *_LAZY]
__getattr__ = lazy_getattr(__name__, _LAZY)
