"""Deterministic evaluation data shared by the gather worker scripts and the tests' single-process references.

Sample ``i`` is ``(x_i, y_i, i)``: 4 features, a label, its own index. A fixed linear "model" predicts a class;
the label is chosen so the prediction is wrong exactly when ``i % 3 == 0``, so duplicated samples (the sampler pads
with the first ones, and sample 0 is wrong) move the accuracy. ``value_i = i + 1`` feeds a sum metric that any
duplicate changes.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, IterableDataset

NUM_CLASSES = 3
FEATURES = 4


def model() -> torch.nn.Linear:
    """The fixed evaluation model (same weights in every process)."""
    gen = torch.Generator().manual_seed(1234)
    layer = torch.nn.Linear(FEATURES, NUM_CLASSES)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(NUM_CLASSES, FEATURES, generator=gen))
        layer.bias.copy_(torch.randn(NUM_CLASSES, generator=gen))
    return layer.eval()


def features(n: int) -> torch.Tensor:
    return torch.randn(n, FEATURES, generator=torch.Generator().manual_seed(n))


def labels(n: int) -> torch.Tensor:
    with torch.no_grad():
        preds = model()(features(n)).argmax(-1)
    idx = torch.arange(n)
    return torch.where(idx % 3 == 0, (preds + 1) % NUM_CLASSES, preds)


class MapData(Dataset):
    """Map-style dataset of ``n`` samples."""

    def __init__(self, n: int) -> None:
        self.x, self.y = features(n), labels(n)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], torch.tensor(i)


class ShardedIterable(IterableDataset):
    """Round-robin shard of ``n`` samples for ``rank`` of ``world``.

    ``padded=True``: the shard repeats its first samples until it holds ``ceil(n / world)`` (like DistributedSampler)
    and ``__len__`` returns ``n``, the total over all ranks. ``padded=False``: only real samples, no ``__len__``.
    """

    def __init__(self, n: int, rank: int, world: int, padded: bool) -> None:
        self.data = MapData(n)
        self.n, self.rank, self.world, self.padded = n, rank, world, padded

    def __iter__(self):
        own = list(range(self.rank, self.n, self.world))
        if self.padded:
            target = -(-self.n // self.world)
            own = own + own[: target - len(own)] if own else [0] * target
        for i in own:
            yield self.data[i]


class LengthIterable(ShardedIterable):
    """A padded round-robin shard that declares the true total with ``__len__``."""

    def __init__(self, n: int, rank: int, world: int, length: int | None = None) -> None:
        super().__init__(n, rank, world, padded=True)
        self._length = n if length is None else length

    def __len__(self) -> int:
        return self._length


def reference(n: int) -> dict[str, torch.Tensor]:
    """Single-process evaluation of all ``n`` samples in dataset order."""
    with torch.no_grad():
        preds = model()(features(n)).argmax(-1)
    return {"preds": preds, "target": labels(n), "idx": torch.arange(n)}
