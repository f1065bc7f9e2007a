"""An evaluation whose ranks run different numbers of batches, shared by the Trainer's and Fabric's ZeRO-3 tests
(``tests/strategies/test_zero_uneven_evaluation.py``, ``tests/fabric/test_fabric_uneven_evaluation.py``) and their
worker scripts: hand-made shards per rank (no DistributedSampler), the model, and the single-process metrics.

Dataloader 0 holds 10 samples (rank 0: 3 batches, rank 1: 2), dataloader 1 holds 7 (rank 0: 1 batch, rank 1: 3), so
neither the per-dataloader nor the total batch counts agree; dataloader 2 (the Trainer's only) gives rank 1 no batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torchmetrics
from torch.utils.data import DataLoader, Subset, TensorDataset

from _support.models import IN_FEATURES, OUT_FEATURES, make_net

NUM_SAMPLES = 20
BATCH_SIZE = 2
MODEL_SEED = 0
#: per dataloader, per rank: the samples of that rank's shard
SHARDS: tuple[tuple[tuple[int, ...], ...], ...] = (
    ((0, 1, 2, 3, 4, 5), (6, 7, 8, 9)),
    ((10, 11), (12, 13, 14, 15, 16)),
    ((17, 18, 19), ()),
)
#: the Fabric loop evaluates the first two (its own code concatenates each rank's outputs)
FABRIC_LOADERS = 2
#: seconds a collective may wait before the run fails: a hang fails quickly
TIMEOUT_S = 30


def dataset() -> TensorDataset:
    """Inputs and class labels, identical in every process."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(NUM_SAMPLES, IN_FEATURES, generator=gen)
    y = torch.randint(0, OUT_FEATURES, (NUM_SAMPLES,), generator=gen)
    return TensorDataset(x, y)


def shard_loader(loader_idx: int, rank: int) -> DataLoader:
    """Rank ``rank``'s shard of dataloader ``loader_idx`` (every sample real: nothing pads it)."""
    return DataLoader(Subset(dataset(), list(SHARDS[loader_idx][rank])), batch_size=BATCH_SIZE)


def batches(loader_idx: int, rank: int) -> int:
    return -(-len(SHARDS[loader_idx][rank]) // BATCH_SIZE)


def pair_checksum(preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum over samples of (pred * C + target + 1)^2: exact in float64, changes with a lost or repeated sample."""
    code = preds.to(torch.float64) * OUT_FEATURES + target.to(torch.float64) + 1
    return (code**2).sum()


def count(preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.tensor(float(len(preds)), dtype=torch.float64)


def metrics() -> dict:
    """The metrics the runs gather: a torchmetrics metric updated per global batch and plain callables (once per
    epoch)."""
    return {
        "acc": torchmetrics.classification.MulticlassAccuracy(OUT_FEATURES, average="micro"),
        "count": count,
        "pairs": pair_checksum,
    }


@torch.no_grad()
def predictions(loader_idx: int, rank: int, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-process predictions and labels of rank ``rank``'s first ``limit`` batches of dataloader ``loader_idx``."""
    net = make_net(MODEL_SEED)
    preds, labels = [], []
    for index, (x, y) in enumerate(shard_loader(loader_idx, rank)):
        if limit is not None and index >= limit:
            break
        preds.append(net(x).argmax(-1))
        labels.append(y)
    if not preds:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    return torch.cat(preds), torch.cat(labels)


def expected(loader_idx: int, ranks: int = 2, limit: int | None = None) -> dict[str, float]:
    """The single-process metrics of dataloader ``loader_idx`` over what every rank evaluates."""
    parts = [predictions(loader_idx, rank, limit) for rank in range(ranks)]
    preds, target = torch.cat([p for p, _ in parts]), torch.cat([t for _, t in parts])
    acc = torchmetrics.classification.MulticlassAccuracy(OUT_FEATURES, average="micro")
    acc.update(preds, target)
    return {
        "acc": float(acc.compute()),
        "count": float(count(preds, target)),
        "pairs": float(pair_checksum(preds, target)),
    }


def per_rank_batches(limit: int | None = None, loaders: Sequence[int] = (0, 1, 2)) -> list[list[int]]:
    """Per rank, the batches it runs of each dataloader (at most ``limit``)."""
    return [[min(batches(i, rank), limit or batches(i, rank)) for i in loaders] for rank in range(2)]
