"""The keyword arguments of the Trainer's ZeRO strategies: lightspeed's ZeRO arguments
(:mod:`lightspeed.core.zero.config.arguments`, the same for every front end) and the Trainer's own few."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from typing_extensions import TypedDict

from lightspeed.core.zero.auto_arguments import ZeroAutoKeywords
from lightspeed.core.zero.config.arguments import ZeroKeywords, ZeroRunKeywords

__all__ = ["TRAINER_DEFAULTS", "TrainerOnlyKeywords", "TrainerZeroAutoKeywords", "TrainerZeroKeywords"]


class TrainerOnlyKeywords(TypedDict, total=False):
    """The arguments only the Trainer's ZeRO strategies take (the default in brackets).

    Attributes:
        sync_with_dataloader: exact gradient accumulation (see ``DeepSpeedExactAccumulationMixin``): ``True`` steps
            the short last window of an epoch with its gradient scaled to its real size; ``False`` requires full
            windows [True].
        start_method: ``"fork"`` starts the worker processes by forking (as Lightning's ``ddp_notebook``); ``None``
            forks in an interactive session (Jupyter, Colab) and otherwise re-runs the script per process [None].
        models: several models in one LightningModule, each with its own engine: the attribute names of the models
            mapped to their own options (``stage``, ``offload_optimizer``, ``offload_parameters``; left out: the
            strategy's), e.g. ``{"generator": {}, "discriminator": {}}`` or ``{"student": {}, "teacher": {"stage":
            3, "offload_parameters": "cpu"}}``. Each optimizer of ``configure_optimizers`` trains one model; a model
            without one is frozen (under ZeRO-3 partitioned, forward only). Checkpoints hold each trained model's
            engine in its own folder; exports write each trained model to ``<dirpath>/<name>/`` [None].
        precision_plugin: Lightning's precision plugin, set by the Trainer from ``Trainer(precision=...)`` [None].
    """

    sync_with_dataloader: bool
    start_method: str | None
    models: Mapping[str, Mapping[str, Any]] | Sequence[str] | None
    precision_plugin: Any


class TrainerZeroKeywords(ZeroKeywords, TrainerOnlyKeywords, total=False):
    """What :class:`~lightspeed.strategies.ZeroStrategy` takes: the ZeRO arguments of every front end
    (:class:`~lightspeed.core.zero.config.arguments.ZeroKeywords`) and the Trainer's own (:class:`TrainerOnlyKeywords`:
    ``sync_with_dataloader``, ``start_method``, ``models``, ``precision_plugin``)."""


class TrainerZeroAutoKeywords(ZeroAutoKeywords, ZeroRunKeywords, TrainerOnlyKeywords, total=False):
    """What :class:`~lightspeed.strategies.ZeroAutoStrategy` takes: its own
    (:class:`~lightspeed.core.zero.auto_arguments.ZeroAutoKeywords`) and those of
    :class:`~lightspeed.strategies.ZeroStrategy` but the stage and offload targets, which it chooses."""


#: the defaults of the Trainer's own arguments
TRAINER_DEFAULTS: Mapping[str, Any] = {
    "sync_with_dataloader": True,
    "start_method": None,
    "models": None,
    "precision_plugin": None,
}
