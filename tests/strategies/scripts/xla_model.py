"""Tiny model, data and plain-PyTorch reference shared by the XLA tests and their worker script.

The module mixes every dtype case the precision modes treat differently: float32 layers, a float64 parameter and a
float64 buffer, an integer buffer, and torchmetrics metrics (which must stay float32).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _support.trainers import QUIET

IN_FEATURES, HIDDEN, OUT_FEATURES = 6, 16, 3
NUM_SAMPLES, BATCH_SIZE, ACCUMULATE = 40, 4, 3  # 10 batches per epoch: windows of 3, 3, 3 and a short 1
LR, MOMENTUM = 0.05, 0.9

# precision mode -> dtypes it leaves (float32 layers, a float64 parameter, a float64 buffer) in; XLAPrecision's
# casting rules as the tests expect them (test_xla_precision.py on plain tensors, test_xla_training.py after a fit)
EXPECTED_DTYPES: dict[str, tuple[torch.dtype, torch.dtype, torch.dtype]] = {
    "32-true": (torch.float32, torch.float64, torch.float64),
    "bf16-true": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "bf16-downcast": (torch.bfloat16, torch.float32, torch.float32),
    "bf16-mixed": (torch.float32, torch.float64, torch.float64),
}


def make_dataset(seed: int = 7) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(NUM_SAMPLES, IN_FEATURES, generator=gen)
    y = torch.randn(NUM_SAMPLES, OUT_FEATURES, generator=gen)
    return TensorDataset(x, y)


def make_loader() -> DataLoader:
    return DataLoader(make_dataset(), batch_size=BATCH_SIZE, shuffle=False)


class InputDtypeProbe(torchmetrics.Metric):
    """A metric that remembers the dtype of every tensor it was updated with."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("count", torch.tensor(0.0), dist_reduce_fx="sum")
        self.seen_dtypes: list[torch.dtype] = []

    def update(self, values: torch.Tensor) -> None:
        self.seen_dtypes.append(values.dtype)
        self.count += values.numel()

    def compute(self) -> torch.Tensor:
        return self.count


class Net(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.hidden = nn.Linear(IN_FEATURES, HIDDEN)
        self.out = nn.Linear(HIDDEN, OUT_FEATURES)
        with torch.no_grad():
            for p in (*self.hidden.parameters(), *self.out.parameters()):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        self.gain64 = nn.Parameter(torch.linspace(0.5, 1.5, OUT_FEATURES, dtype=torch.float64))
        self.register_buffer("shift64", torch.full((OUT_FEATURES,), 0.1, dtype=torch.float64))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.out(torch.tanh(self.hidden(x)))
        return h * self.gain64.to(h.dtype) + self.shift64.to(h.dtype)


class XLATestModule(L.LightningModule):
    """MSE regression with SGD+momentum; records its per-micro-batch losses (as tensors, synced once at the end)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.net = Net(seed)
        self.mse = torchmetrics.MeanSquaredError()
        self.probe = InputDtypeProbe()
        self._losses: list[torch.Tensor] = []
        self.step_losses: list[float] = []
        self.loss_dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        loss = nn.functional.mse_loss(out, y.to(out.dtype))
        self.mse.update(out.detach(), y)
        self.probe.update(out.detach())
        self.log("loss", loss)
        self._losses.append(loss.detach())
        self.loss_dtypes.append(loss.dtype)
        return loss

    def on_train_end(self) -> None:
        if self._losses:  # idempotent: a callback may collect first
            self.step_losses = torch.stack([t.float() for t in self._losses]).cpu().tolist()
            self._losses = []

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


def reference_exact_training(epochs: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain PyTorch on CPU, float32 (float64 where the model is): each window of ``ACCUMULATE`` batches (the last
    one of an epoch short) is one step on the mean loss over all of the window's samples."""
    net = Net(seed)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    batches = list(make_loader())
    losses: list[float] = []
    for _ in range(epochs):
        for start in range(0, len(batches), ACCUMULATE):
            window = batches[start : start + ACCUMULATE]
            opt.zero_grad()
            outs = [net(x) for x, _ in window]
            for out, (_, y) in zip(outs, window, strict=False):
                losses.append(float(nn.functional.mse_loss(out.detach(), y)))
            big = nn.functional.mse_loss(torch.cat(outs), torch.cat([y for _, y in window]))
            big.backward()
            opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, losses


def trainer_kwargs(root: str, **overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        QUIET,
        accelerator="xla",
        devices=1,
        max_epochs=2,
        accumulate_grad_batches=ACCUMULATE,
        default_root_dir=root,
    )
    kwargs.update(overrides)
    return kwargs
