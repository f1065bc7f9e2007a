"""Every rank of a sequence-parallel group must split the same rows: a check on each batch before it is split.

The ranks of a group each keep a slice of every sequence and exchange activations; if they read different rows (an
``IterableDataset`` or a sampler of the user's own that splits by global rank, a shuffle seeded per rank) the
attention would splice the first half of one sequence to the second half of another and train on it, silently. Each
rank fingerprints its batch (shape and a position-weighted sum of its token ids and labels) and the group compares
the fingerprints: one small all-gather per batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from lightspeed.core.errors import SequenceParallelError

__all__ = ["batch_fingerprint", "check_same_rows"]

_MULTIPLIER = 2654435761  # Knuth's multiplicative hash: neighbouring positions get unrelated weights


def batch_fingerprint(batch: Mapping[str, Any]) -> torch.Tensor:
    """``[rows, positions, hash of input_ids, hash of labels]`` (int64, on ``input_ids``' device); equal batches give
    equal fingerprints on every rank, and rows that differ in any token almost surely do not."""
    input_ids: torch.Tensor = batch["input_ids"]
    labels = batch.get("labels")
    rows, length = input_ids.shape
    weights = (torch.arange(rows * length, device=input_ids.device, dtype=torch.int64) * _MULTIPLIER) % (1 << 31) + 1
    weights = weights.view(rows, length)

    def digest(values: Any) -> torch.Tensor:
        if not isinstance(values, torch.Tensor) or values.shape != input_ids.shape:
            return torch.zeros((), dtype=torch.int64, device=input_ids.device)
        return ((values.to(torch.int64) + 101) * weights).sum()

    shape = torch.tensor([rows, length], dtype=torch.int64, device=input_ids.device)
    return torch.cat([shape, digest(input_ids).view(1), digest(labels).view(1)])


def check_same_rows(batch: Mapping[str, Any], group: Any, size: int) -> None:
    """Raise on every rank of ``group`` (``size`` ranks) when its ranks hold different batches (a collective: every
    rank of the group calls it for every batch)."""
    own = batch_fingerprint(batch)
    every = [torch.empty_like(own) for _ in range(size)]
    dist.all_gather(every, own, group=group)
    if all(torch.equal(other, every[0]) for other in every[1:]):
        return
    ranks = dist.get_process_group_ranks(group)
    shapes = ", ".join(
        f"rank {rank}: {int(fp[0])} rows x {int(fp[1])} positions" for rank, fp in zip(ranks, every, strict=True)
    )
    raise SequenceParallelError(
        f"ranks {ranks} form one sequence-parallel group and must split the same rows, but their batches differ "
        f"({shapes}; where the shapes agree, the tokens or labels differ). lightspeed's sampler gives a group's "
        "ranks the same rows; an IterableDataset or a sampler of your own that splits by global rank does not: split "
        "the data by data-parallel group instead (part rank // sequence_parallel_size of world_size // "
        "sequence_parallel_size), shuffled with the same seed on every rank."
    )
