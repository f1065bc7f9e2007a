"""A LightningModule whose loss does not depend on the batch (the net's output on a fixed probe), so that one SGD step
from given weights is the same on every rank and in a single process: the test recomputes it from the loaded weights."""

from __future__ import annotations

import lightning as L
import torch

from _support.models import IN_FEATURES, make_net

LR = 0.1


def probe_loss(net: torch.nn.Module) -> torch.Tensor:
    probe = torch.linspace(-1, 1, 4 * IN_FEATURES).reshape(4, IN_FEATURES)
    return net(probe).pow(2).mean()


class ProbeModule(L.LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net = make_net(seed)

    def training_step(self, batch, batch_idx):
        return probe_loss(self.net) + 0.0 * batch[0].sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)
