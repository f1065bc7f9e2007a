"""Data, models and window layout shared by the accumulation worker scripts and the tests' plain-PyTorch references.

Everything is generated from fixed seeds, so a worker rank and the test build bit-identical tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def toy_data(n: int = 8) -> tuple[Tensor, Tensor]:
    """x = 1..n, y = 2x: the classic accumulation toy."""
    x = torch.arange(1, n + 1, dtype=torch.float32).unsqueeze(1)
    return x, 2 * x


def regression_data(n: int = 20) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 4, generator=gen), torch.randn(n, 2, generator=gen)


def token_data(n: int = 24, max_len: int = 6, dim: int = 3, classes: int = 4, empty: bool = False):
    """Variable-length sequences: even indices hold 1-2 tokens, odd ones 5-6, so ranks see different token counts."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, max_len, dim, generator=gen)
    targets = torch.randint(0, classes, (n, max_len), generator=gen)
    lengths = torch.tensor([0 if empty else 1 + 4 * (i % 2) + (i // 2) % 2 for i in range(n)])
    mask = torch.arange(max_len).unsqueeze(0) < lengths.unsqueeze(1)
    return x, targets, mask


def make_data(task: str):
    if task == "toy":
        return toy_data(8)
    if task == "toy9":
        return toy_data(9)
    if task == "regression":
        return regression_data(20)
    if task == "regression16":
        return regression_data(16)
    if task == "tokens":
        return token_data()
    if task == "tokens_empty":
        return token_data(n=4, empty=True)
    raise ValueError(task)


def make_model(task: str) -> nn.Module:
    if task.startswith("toy"):
        model = nn.Linear(1, 1, bias=False)
        nn.init.zeros_(model.weight)
        return model
    torch.manual_seed(2)
    if task.startswith("regression"):
        return nn.Linear(4, 2)
    return nn.Linear(3, 4)


def item_loss(task: str, model: nn.Module, batch) -> tuple[Tensor, Tensor]:
    """(sum of per-item losses, number of items) of one batch: samples for regression, tokens for sequences."""
    if task.startswith("tokens"):
        x, targets, mask = batch
        logits = model(x)
        loss_sum = nn.functional.cross_entropy(logits[mask], targets[mask], reduction="sum")
        return loss_sum, mask.sum()
    x, y = batch
    return nn.functional.mse_loss(model(x), y, reduction="sum") / y.shape[1], torch.tensor(x.shape[0])


def rank_batches(n: int, world_size: int, rank: int, batch_size: int) -> list[list[int]]:
    """Sample indices of each batch of ``rank`` (DistributedSampler order without shuffling)."""
    indices = list(range(rank, n, world_size))
    return [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]


def windows(n: int, world_size: int, batch_size: int, accumulate: int) -> list[list[int]]:
    """Sample indices of each step's big batch: ``accumulate`` batches of every rank (the last window may be short)."""
    per_rank = [rank_batches(n, world_size, r, batch_size) for r in range(world_size)]
    steps = []
    for start in range(0, len(per_rank[0]), accumulate):
        steps.append(sorted(i for batches in per_rank for b in batches[start : start + accumulate] for i in b))
    return steps


def reference_training(spec: dict, world_size: int) -> tuple[dict, float, int]:
    """Plain PyTorch, one process: every optimizer step sees its whole window as one big batch and its mean loss.

    Returns (state_dict, final learning rate, optimizer steps). ``spec`` is a worker case (task, batch_size per rank,
    accumulate, lr, epochs, optional clip and scheduler).
    """
    data = make_data(spec["task"])
    model = make_model(spec["task"])
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"])
    scheduler = None
    if spec.get("scheduler") == "steps":
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: float(step))
    steps = windows(len(data[0]), world_size, spec["batch_size"], spec["accumulate"])
    for _ in range(spec.get("epochs", 1)):
        for indices in steps:
            optimizer.zero_grad()
            loss_sum, items = item_loss(spec["task"], model, tuple(t[indices] for t in data))
            (loss_sum / items).backward()
            if spec.get("clip"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"])
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
    return model.state_dict(), optimizer.param_groups[0]["lr"], len(steps) * spec.get("epochs", 1)
