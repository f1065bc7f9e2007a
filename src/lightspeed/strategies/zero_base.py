"""What the first base of :class:`~lightspeed.strategies.ZeroStrategy` (its engine construction,
:mod:`lightspeed.strategies.zero_engine`) is type-checked as: the strategy's mixins after it, whose members it calls.
At run time it derives from ``object``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightspeed.core.zero.session import ZeroConfigProperties
    from lightspeed.strategies.exact_accumulation import DeepSpeedExactAccumulationMixin
    from lightspeed.strategies.zero_checkpoints import ZeroCheckpointsMixin

    class ZeroStrategyBase(  # type: ignore[misc]
        ZeroConfigProperties, DeepSpeedExactAccumulationMixin, ZeroCheckpointsMixin
    ): ...

else:
    ZeroStrategyBase = object

__all__ = ["ZeroStrategyBase"]
