"""What the first base of :class:`~lightspeed.fabric.ZeroFabricStrategy` (its engine construction,
:mod:`lightspeed.fabric.zero_engine`) is type-checked as: the strategy's mixins after it, whose members it calls. At run
time it derives from ``object``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightspeed.core.zero.session import ZeroConfigProperties
    from lightspeed.fabric.process_group import ProcessGroupMixin
    from lightspeed.fabric.zero_checkpoints import ZeroCheckpointsMixin

    class ZeroStrategyBase(ZeroConfigProperties, ProcessGroupMixin, ZeroCheckpointsMixin): ...  # type: ignore[misc]

else:
    ZeroStrategyBase = object

__all__ = ["ZeroStrategyBase"]
