"""Small deterministic models and data shared by tests and the worker scripts they launch."""

from __future__ import annotations

from collections.abc import Collection

import lightning as L
import torch
from torch import nn
from torch.utils.data import TensorDataset

IN_FEATURES, HIDDEN, OUT_FEATURES = 13, 37, 5  # odd sizes force ZeRO padding


def make_regression_data(n: int = 64, seed: int = 1234) -> TensorDataset:
    """Deterministic inputs/targets, identical in every process."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN_FEATURES, generator=gen)
    y = torch.randn(n, OUT_FEATURES, generator=gen)
    return TensorDataset(x, y)


def make_net(seed: int = 0) -> nn.Sequential:
    """A two-layer MLP with deterministic initial weights."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT_FEATURES))
    torch.random.set_rng_state(gen_state)
    return net


class RegressionModule(L.LightningModule):
    """Plain LightningModule: MSE regression with AdamW, as a user would write it."""

    def __init__(self, lr: float = 1e-2, weight_decay: float = 0.01, seed: int = 0, optimizer: str = "adamw"):
        super().__init__()
        self.net = make_net(seed)
        self.lr, self.weight_decay, self.optimizer_name = lr, weight_decay, optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.optimizer_name == "two":
            return [torch.optim.SGD(self.parameters(), lr=self.lr), torch.optim.SGD(self.parameters(), lr=self.lr)]
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


def rank_batches(n: int, world_size: int, batch: int, epoch: int, seed: int = 0) -> list[list[list[int]]]:
    """Sample indices per step and rank, exactly as Lightning's DistributedSampler (shuffled, seeded) hands them out."""
    from torch.utils.data import DistributedSampler

    per_rank = []
    for rank in range(world_size):
        sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        indices = list(sampler)
        per_rank.append([indices[i : i + batch] for i in range(0, len(indices), batch)])
    return [list(step) for step in zip(*per_rank, strict=False)]


def reference_training(
    steps: int,
    world_size: int,
    batch: int,
    lr: float = 1e-2,
    weight_decay: float = 0.01,
    seed: int = 0,
    n: int = 64,
    net: nn.Module | None = None,
    skipped: Collection[int] = (),
) -> dict[str, torch.Tensor]:
    """Plain single-process PyTorch AdamW on the same global batches the ranks of a distributed run see.

    Each global batch is the union of the ranks' micro-batches; with equal micro-batch sizes the mean of the ranks'
    mean losses (what data-parallel averaging optimises) is the mean over the global batch. ``net`` trains another
    network on the same data (default: ``make_net(seed)``); it is trained in place. ``skipped``: the steps (from 0)
    whose batch is consumed without an update, as fp16 loss scaling skips a step whose gradients overflowed.
    """
    data = make_regression_data(n)
    net = make_net(seed) if net is None else net
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    done, epoch = 0, 0
    while done < steps:
        for step in rank_batches(n, world_size, batch, epoch):
            if done == steps:
                break
            if done in skipped:
                done += 1
                continue
            index = torch.tensor([i for rank_indices in step for i in rank_indices])
            x, y = data.tensors[0][index], data.tensors[1][index]
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            done += 1
        epoch += 1
    return {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}


def relative_update_error(
    weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]
) -> float:
    """How far a run's training moved the weights from where the reference's moved them, relative to the reference's
    movement: ``||w - ref|| / ||ref - init||`` over every tensor together. Half-precision runs are compared this way:
    a few elements whose tiny gradient changes sign in bf16 move by 2 lr under Adam, so a maximum over elements says
    little, while a wrong update shows clearly (the last of 10 steps missed: 0.08; the first: 0.62)."""
    error = sum(((weights[k].float() - reference[k].float()) ** 2).sum() for k in reference)
    moved = sum(((reference[k].float() - initial[k].float()) ** 2).sum() for k in reference)
    return float((error / moved).sqrt())


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (gathered) parameters of a module, also under ZeRO-3, on every rank."""
    params = list(module.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {k: v.detach().clone().float().cpu() for k, v in module.state_dict().items()}
    return {k: v.detach().clone().float().cpu() for k, v in module.state_dict().items()}
