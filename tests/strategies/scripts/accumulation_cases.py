"""Data, models and window layout shared by the accumulation worker scripts and the tests' plain-PyTorch references.

Everything is generated from fixed seeds, so a worker rank and the test build bit-identical tensors.
"""

from __future__ import annotations

import math

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


class AccumulationWindows:
    """Reference window arithmetic for plain loops: which micro-batch closes a window and how big each one really is.

    ``accumulate`` micro-batches make one optimizer step (one *window*). When a pass over the data is not a multiple
    of ``accumulate`` batches, its last window is short; :meth:`loss_scale` repairs a loss already divided by
    ``accumulate`` for it. Test-only (no product code cuts windows this way; the strategies follow Lightning's loop).

    ``sync_with_dataloader`` here picks how windows are cut, which is *not* what the strategies' flag of that name
    means (there: whether a short last window steps or is an error): ``True`` (default): windows restart with every
    pass, the last one of a pass may be short and still steps; ``False``: windows run over the concatenated stream of
    passes, so every window holds exactly ``accumulate`` micro-batches.

    Args:
        accumulate: micro-batches per optimizer step (``accumulate_grad_batches``).
        num_batches: batches in one pass, or ``None`` when unknown (an iterable dataset without ``__len__``).
        sync_with_dataloader: close the window at the end of every pass (see above).

    A plain class, not a dataclass: the tests load this file with ``importlib`` outside ``sys.modules``, where
    ``dataclasses`` cannot resolve postponed annotations.
    """

    def __init__(self, accumulate: int, num_batches: int | None = None, sync_with_dataloader: bool = True) -> None:
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate must be a positive integer (accumulate_grad_batches), got {accumulate!r}.")
        if num_batches is not None and (
            isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0
        ):
            raise ValueError(
                f"num_batches must be a non-negative integer, or None when the dataloader has no length; "
                f"got {num_batches!r}."
            )
        self.accumulate = accumulate
        self.num_batches = num_batches
        self.sync_with_dataloader = sync_with_dataloader

    def _position(self, batch_idx: int, epoch: int) -> int:
        """Index of the micro-batch in the stream the windows are cut from."""
        if batch_idx < 0 or epoch < 0:
            raise ValueError(f"batch_idx and epoch must be non-negative, got batch_idx={batch_idx}, epoch={epoch}.")
        if self.num_batches is not None and batch_idx >= self.num_batches:
            raise ValueError(f"batch_idx {batch_idx} is past the end of a pass of {self.num_batches} batches.")
        if self.sync_with_dataloader or epoch == 0:
            return batch_idx
        if self.num_batches is None:
            raise ValueError(
                "With sync_with_dataloader=False, windows continue across passes, so the number of batches per pass "
                "must be known: pass num_batches."
            )
        return epoch * self.num_batches + batch_idx

    def window_index(self, batch_idx: int, epoch: int = 0) -> int:
        """Index of the window holding micro-batch ``batch_idx`` (counted within the pass when syncing with it)."""
        return self._position(batch_idx, epoch) // self.accumulate

    def opens_window(self, batch_idx: int, epoch: int = 0) -> bool:
        """Whether ``batch_idx`` opens a window (the point where gradients are zeroed)."""
        return self._position(batch_idx, epoch) % self.accumulate == 0

    def window_size(self, batch_idx: int, epoch: int = 0) -> int:
        """Real number of micro-batches in the window holding ``batch_idx`` (unknown for an unsized pass's last)."""
        position = self._position(batch_idx, epoch)
        if not self.sync_with_dataloader:
            return self.accumulate
        start = position - position % self.accumulate
        if self.num_batches is None:
            raise ValueError(
                "The size of the last window is unknown because the dataloader has no length; count the window's "
                "micro-batches as they arrive (ExactAccumulator does) or pass num_batches."
            )
        return min(self.accumulate, self.num_batches - start)

    def is_boundary(self, batch_idx: int, epoch: int = 0, is_last_batch: bool = False) -> bool:
        """Whether the optimizer steps after micro-batch ``batch_idx`` (``is_last_batch``: end of an unsized pass)."""
        position = self._position(batch_idx, epoch)
        if (position + 1) % self.accumulate == 0:
            return True
        if not self.sync_with_dataloader:
            return False
        return is_last_batch or (self.num_batches is not None and batch_idx == self.num_batches - 1)

    def loss_scale(self, batch_idx: int, epoch: int = 0) -> float:
        """Factor for a loss already divided by ``accumulate`` so that the window's mean uses its real size ``k``."""
        return self.accumulate / self.window_size(batch_idx, epoch)

    def steps_per_pass(self) -> int:
        """Optimizer steps in one pass over the dataloader (``sync_with_dataloader=True``)."""
        if self.num_batches is None:
            raise ValueError("The number of steps per pass is unknown because the dataloader has no length.")
        if not self.sync_with_dataloader:
            raise ValueError(
                "With sync_with_dataloader=False windows span passes, so steps differ between passes; "
                "use total_steps(num_passes)."
            )
        return math.ceil(self.num_batches / self.accumulate)

    def total_steps(self, num_passes: int) -> int:
        """Optimizer steps over ``num_passes`` passes (a trailing incomplete window never steps without syncing)."""
        if self.num_batches is None:
            raise ValueError("The number of steps is unknown because the dataloader has no length.")
        if self.sync_with_dataloader:
            return num_passes * self.steps_per_pass()
        return (num_passes * self.num_batches) // self.accumulate


def reference_training(spec: dict, world_size: int) -> tuple[dict, float, int]:
    """Plain PyTorch, one process: every optimizer step sees its whole window as one big batch and its mean loss.

    Returns (state_dict, final learning rate, optimizer steps). ``spec`` is a worker case (task, batch_size per rank,
    accumulate, lr, epochs, optional clip and scheduler).
    """
    model, optimizer, gradients = _reference_run(spec, world_size)
    return model.state_dict(), optimizer.param_groups[0]["lr"], len(gradients)


def reference_gradients(spec: dict, world_size: int) -> list[dict]:
    """The big-batch gradient of every optimizer step of :func:`reference_training` (before clipping), by name."""
    return _reference_run(spec, world_size)[2]


def _reference_run(spec: dict, world_size: int) -> tuple[nn.Module, torch.optim.Optimizer, list[dict]]:
    """The reference run: the model, its optimizer, and each step's gradient before clipping."""
    data = make_data(spec["task"])
    model = make_model(spec["task"])
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"])
    scheduler = None
    if spec.get("scheduler") == "steps":
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: float(step))
    gradients = []
    for _ in range(spec.get("epochs", 1)):
        for indices in windows(len(data[0]), world_size, spec["batch_size"], spec["accumulate"]):
            optimizer.zero_grad()
            loss_sum, items = item_loss(spec["task"], model, tuple(t[indices] for t in data))
            (loss_sum / items).backward()
            gradients.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
            if spec.get("clip"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"])
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
    return model, optimizer, gradients
