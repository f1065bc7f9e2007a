"""The trials' batches: the run's first micro-batches, as its loader yields them or batched anew to another size."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset

__all__ = ["first_batches", "rebatched"]


def rebatched(loader: Iterable[Any], batch_size: int) -> DataLoader:
    """``loader``'s samples in its order (its sampler) and collated its way, in batches of ``batch_size``; only a
    ``torch.utils.data.DataLoader`` that batches with ``batch_size`` can be re-batched."""
    if (
        not isinstance(loader, DataLoader)
        or loader.batch_size is None
        or type(loader.batch_sampler) is not BatchSampler
    ):
        raise ValueError(
            f"tune_micro_batches re-batches the training data, which needs a torch DataLoader built with batch_size=; "
            f"got {type(loader).__name__}"
            f"{' with a batch sampler of its own' if isinstance(loader, DataLoader) else ''}. Leave tune_micro_batches "
            "unset for this data."
        )
    if isinstance(loader.dataset, IterableDataset):
        return DataLoader(
            loader.dataset, batch_size=batch_size, collate_fn=loader.collate_fn, drop_last=loader.drop_last
        )
    return DataLoader(
        loader.dataset,
        batch_size=batch_size,
        sampler=loader.sampler,
        collate_fn=loader.collate_fn,
        drop_last=loader.drop_last,
    )


def first_batches(loader: Iterable[Any], count: int, batch_size: int | None = None) -> list[Any]:
    """The first ``count`` batches of ``loader``; with ``batch_size``, of that many samples each (:func:`rebatched`).
    Callers preserve the random number generators around it (a shuffling sampler draws from them)."""
    source = rebatched(loader, batch_size) if batch_size is not None else loader
    return list(itertools.islice(iter(source), count))
