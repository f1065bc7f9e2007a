"""The keyword arguments of Fabric's ZeRO strategies: lightspeed's ZeRO arguments
(:mod:`lightspeed.core.zero.config.arguments`, the same for every front end) and Fabric's precision."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.nn import Module
from typing_extensions import TypedDict

from lightspeed.core.zero.auto_arguments import ZeroAutoKeywords
from lightspeed.core.zero.config.arguments import ZeroKeywords, ZeroRunKeywords

__all__ = [
    "FABRIC_DEFAULTS",
    "FabricOnlyKeywords",
    "FabricTuneKeywords",
    "FabricZeroAutoKeywords",
    "FabricZeroKeywords",
]


class FabricOnlyKeywords(TypedDict, total=False):
    """What only Fabric's ZeRO strategies take.

    Attributes:
        precision: Fabric's precision plugin, set by Fabric from ``Fabric(precision=...)`` [None].
    """

    precision: Any


class FabricZeroKeywords(ZeroKeywords, FabricOnlyKeywords, total=False):
    """What :class:`~lightspeed.fabric.ZeroFabricStrategy` takes: the ZeRO arguments of every front end
    (:class:`~lightspeed.core.zero.config.arguments.ZeroKeywords`) and ``precision``."""


class FabricTuneKeywords(TypedDict, total=False):
    """What Fabric's ``zero_auto`` needs to tune (``tune=True``) that the Trainer knows from its loop.

    Attributes:
        tune_batches: this rank's training micro-batches (e.g. the ``DataLoader`` of the loop, before
            ``fabric.setup_dataloaders``); the first few are used, moved to the device [None].
        tune_loss: ``(model, batch) -> loss`` for one micro-batch, as the loop computes it [None].
    """

    tune_batches: Iterable[Any] | None
    tune_loss: Callable[[Module, Any], torch.Tensor] | None


class FabricZeroAutoKeywords(ZeroAutoKeywords, FabricTuneKeywords, ZeroRunKeywords, FabricOnlyKeywords, total=False):
    """What :class:`~lightspeed.fabric.ZeroAutoFabricStrategy` takes: ``zero_auto``'s own
    (:class:`~lightspeed.core.zero.auto_arguments.ZeroAutoKeywords`, :class:`FabricTuneKeywords`) and those of
    :class:`~lightspeed.fabric.ZeroFabricStrategy` but the stage and offload targets, which it chooses."""


#: the default of the argument every Fabric ZeRO strategy takes
FABRIC_DEFAULTS: Mapping[str, Any] = {"precision": None}
