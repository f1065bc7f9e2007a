"""What lightspeed's Trainer strategy mixins are type-checked as: each mixin sits before one of Lightning's strategy
classes in a strategy's bases and calls it through ``super()``. At run time they derive from ``object``, so that the
Lightning class stays where the strategy puts it in the method resolution order."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning.pytorch.strategies import DeepSpeedStrategy, ParallelStrategy, Strategy

    DeepSpeedStrategyBase = DeepSpeedStrategy
    ParallelStrategyBase = ParallelStrategy
    StrategyBase = Strategy
else:
    DeepSpeedStrategyBase = ParallelStrategyBase = StrategyBase = object

__all__ = ["DeepSpeedStrategyBase", "ParallelStrategyBase", "StrategyBase"]
