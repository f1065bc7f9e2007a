"""What lightspeed's Fabric strategy mixins are type-checked as: each mixin sits before one of Lightning Fabric's
strategy classes in a strategy's bases and calls it through ``super()``. At run time they derive from ``object``, so
that the Fabric class stays where the strategy puts it in the method resolution order."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy

    DDPStrategyBase = DDPStrategy
    DeepSpeedStrategyBase = DeepSpeedStrategy
else:
    DDPStrategyBase = DeepSpeedStrategyBase = object

__all__ = ["DDPStrategyBase", "DeepSpeedStrategyBase"]
