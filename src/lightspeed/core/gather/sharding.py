"""``shard_iterable``: give each rank (and each DataLoader worker of that rank) its own share of an iterable dataset.

An ``IterableDataset`` that yields the whole dataset on every rank makes every rank evaluate every sample: the
gathered result then holds each sample ``world_size`` times. :func:`shard_iterable` wraps any iterable dataset so
that rank ``r`` of ``W`` keeps the samples ``i`` with ``i % W == r`` (the round-robin layout that
``DistributedSampler`` and the gather accounting use), and within a rank DataLoader worker ``w`` of ``N`` keeps the
rank's chunks ``c`` of ``batch_size`` samples with ``c % N == w`` (so the loader, which takes one batch from each
worker in turn, yields the rank's samples in order).

When the total number of samples is known (``len(dataset)`` or ``length=``), every rank yields the same number of
samples, ``ceil(total / W)``: a rank with one sample fewer repeats the stream's first sample at its end, and the
wrapper's ``len()`` is the total, so :func:`lightspeed.gather_for_metrics` drops exactly that padding. Without a
total nothing is padded and ranks may run different numbers of batches: a gather per batch then meets a rank that
has finished (an error on every rank), a gather of everything after the loop does not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

__all__ = ["ShardedIterable", "shard_iterable"]


class ShardedIterable(IterableDataset):
    """The share of ``dataset`` that this rank and DataLoader worker iterate (see the module docstring)."""

    #: read by the gather accounting: this dataset is sharded across ranks by construction
    lightspeed_sharded = True

    def __init__(
        self,
        dataset: Iterable[Any],
        length: int | None = None,
        batch_size: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if length is None and hasattr(type(dataset), "__len__"):
            try:
                length = len(dataset)  # type: ignore[arg-type]
            except (TypeError, NotImplementedError):
                length = None
        if length is not None and length < 0:
            raise ValueError(f"shard_iterable(length={length}): the total number of samples must be >= 0.")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"shard_iterable(batch_size={batch_size}): must be >= 1.")
        self.dataset, self.length, self.batch_size = dataset, length, batch_size
        self.rank, self.world_size = rank, world_size

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError(
                "this shard_iterable has no total length (the wrapped dataset has no __len__); pass length=..."
            )
        return self.length

    def _rank_and_world(self) -> tuple[int, int]:
        initialized = dist.is_available() and dist.is_initialized()
        rank = self.rank if self.rank is not None else (dist.get_rank() if initialized else 0)
        world = self.world_size if self.world_size is not None else (dist.get_world_size() if initialized else 1)
        return rank, world

    def __iter__(self) -> Iterator[Any]:
        rank, world = self._rank_and_world()
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if workers > 1 and self.batch_size is None:
            raise ValueError(
                f"shard_iterable: the DataLoader runs {workers} workers; pass shard_iterable(dataset, "
                "batch_size=<the DataLoader's batch_size>) so each worker takes whole batches of this rank's share in "
                "turn and the batches come back in order."
            )
        chunk = self.batch_size or 1

        def mine(position: int) -> bool:  # the rank's position-th sample belongs to this worker
            return (position // chunk) % workers == worker

        first: Any = None
        count = 0
        for index, sample in enumerate(self.dataset):
            if index == 0:
                first = sample
            count = index + 1
            if index % world == rank and mine(index // world):
                yield sample
        if self.length is None or count == 0:
            return
        own = len(range(rank, count, world))
        for position in range(own, math.ceil(count / world)):  # pad the shard to the longest rank's share
            if mine(position):
                yield first


def shard_iterable(
    dataset: Iterable[Any], *, length: int | None = None, batch_size: int | None = None
) -> ShardedIterable:
    """Wrap an iterable dataset that yields the whole dataset so each rank (and DataLoader worker) gets its share.

    Sample ``i`` goes to rank ``i % world_size``; ``len()`` of the result is the total (``len(dataset)`` or
    ``length=``), and each rank's share is padded to the same number of samples, so
    :func:`lightspeed.gather_for_metrics` returns each sample exactly once, in dataset order. With DataLoader
    workers, pass the loader's ``batch_size`` (each worker takes whole batches in turn). The rank and world size are
    read from the process group when iterated. ``DataLoader(shard_iterable(stream), batch_size=8)``.

    Args:
        dataset: an iterable (e.g. an ``IterableDataset``) that yields the whole dataset on every rank.
        length: the number of samples, when ``dataset`` has no ``len()`` (``None``: unknown, nothing padded).
        batch_size: the DataLoader's batch size, needed with DataLoader workers.
    """
    return ShardedIterable(dataset, length=length, batch_size=batch_size)
