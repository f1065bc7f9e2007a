"""Models for the zero_auto tests: a deeper regression MLP whose largest layer is small next to the whole model
(so ZeRO-3 can be the option that fits), optionally built in ``configure_model``. Its single-process reference is
``_support.models.reference_training(..., net=make_deep_net())``."""

from __future__ import annotations

import torch
from torch import nn

from _support.models import IN_FEATURES, OUT_FEATURES, RegressionModule

WIDTH, DEPTH = 32, 4


def make_deep_net(seed: int = 0) -> nn.Sequential:
    """Linear(13, 32), 4 x Linear(32, 32), Linear(32, 5) with tanh between: deterministic initial weights."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(IN_FEATURES, WIDTH), nn.Tanh()]
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    layers.append(nn.Linear(WIDTH, OUT_FEATURES))
    net = nn.Sequential(*layers)
    torch.random.set_rng_state(state)
    return net


class DeepRegressionModule(RegressionModule):
    """RegressionModule with the deeper net, created in ``__init__`` or (``in_configure_model=True``) later."""

    def __init__(self, in_configure_model: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seed = kwargs.get("seed", 0)
        self.net = None if in_configure_model else make_deep_net(self.seed)

    def configure_model(self) -> None:
        if self.net is None:
            self.net = make_deep_net(self.seed)
