"""``lightspeed.fabric.config_optimizer()``: train with the optimizer (and scheduler) the DeepSpeed config
describes, through ``fabric.setup``, which takes optimizer objects only."""

from __future__ import annotations

__all__ = ["ConfigOptimizer", "config_optimizer"]


class ConfigOptimizer:
    """Stands for the optimizer the DeepSpeed config's ``"optimizer"`` section describes (see
    :func:`config_optimizer`)."""


def config_optimizer() -> ConfigOptimizer:
    """Pass to ``fabric.setup`` for the optimizer (and scheduler) of the DeepSpeed config::

        model, optimizer = fabric.setup(model, lightspeed.fabric.config_optimizer())

    DeepSpeed builds them from the config's ``"optimizer"``/``"scheduler"`` sections; ``optimizer.step()`` then
    steps the config's scheduler too, as ``engine.step()`` does (a scheduler ``"auto"`` peak LR is the config
    optimizer's ``lr``)."""
    return ConfigOptimizer()
