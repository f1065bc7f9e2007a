"""A ``DistributedSampler`` whose position within an epoch is saved in checkpoints, for exact mid-epoch resume.

It hands out exactly the indices ``torch.utils.data.DistributedSampler`` hands out (same permutation for the same
seed and epoch, same padding, same interleaving across ranks), so a run with it equals a run with Lightning's
injected sampler. Its ``state_dict`` records how many samples of the epoch the whole job has consumed, counted in
the epoch's global (padded, permuted) order: ``batches done * batch_size * num_replicas``. The count of batches done
comes from the training loop (``consumed_batches``), not from the indices yielded, which run ahead of training by
the loader's prefetching. After ``load_state_dict`` the next iteration of the same epoch skips those samples, on any
number of processes: rank ``r`` of ``R`` takes the rest of the epoch's global order at positions ``r, r + R, ...``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data import DistributedSampler

__all__ = ["ResumableDistributedSampler"]


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` with ``state_dict``/``load_state_dict`` for exact mid-epoch resume.

    Args:
        consumed_batches: returns how many batches of the current epoch this rank's training loop has finished.
        batch_size: the loader's batch size (every batch before the last of an epoch is full).
        other arguments: as ``DistributedSampler``.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        num_replicas: int,
        rank: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        batch_size: int,
        consumed_batches: Callable[[], int],
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.batch_size = batch_size
        self._consumed_batches = consumed_batches
        self._resume: tuple[int, int] | None = None  # (epoch, global samples to skip) for the next iteration

    @classmethod
    def replacing(
        cls, sampler: DistributedSampler, batch_size: int, consumed_batches: Callable[[], int]
    ) -> ResumableDistributedSampler:
        """The resumable twin of ``sampler`` (same dataset, ranks, shuffling, seed, drop_last and epoch)."""
        twin = cls(
            sampler.dataset,
            num_replicas=sampler.num_replicas,
            rank=sampler.rank,
            shuffle=sampler.shuffle,
            seed=sampler.seed,
            drop_last=sampler.drop_last,
            batch_size=batch_size,
            consumed_batches=consumed_batches,
        )
        twin.set_epoch(sampler.epoch)
        return twin

    def _dataset_size(self) -> int:
        return len(cast(Sized, self.dataset))

    def _epoch_order(self) -> list[int]:
        """The epoch's global order: permuted (or not), padded or cut to ``total_size`` as DistributedSampler does."""
        n = self._dataset_size()
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=generator).tolist()
        else:
            indices = list(range(n))
        if self.drop_last:
            return indices[: self.total_size]
        padding = self.total_size - len(indices)
        return indices + (indices * math.ceil(padding / len(indices)))[:padding] if padding > 0 else indices

    def __iter__(self) -> Iterator[int]:
        skip = 0
        if self._resume is not None:
            epoch, samples = self._resume
            self._resume = None  # only the first iteration after a restore resumes mid-epoch
            if epoch == self.epoch:
                skip = samples
            elif epoch < self.epoch and samples < self.total_size:
                warnings.warn(
                    f"lightspeed: the checkpoint stopped epoch {epoch} after {samples} of its {self.total_size} "
                    f"samples, but training resumes at epoch {self.epoch}, so the rest of epoch {epoch} is not trained "
                    "(Lightning counts an epoch that `max_steps` ended as finished, and a checkpoint saved after "
                    "`fit` returned says so). For an exact continuation, resume from a checkpoint saved during "
                    "training, e.g. `ModelCheckpoint(every_n_train_steps=...)`.",
                    stacklevel=2,
                )
        order = self._epoch_order()[skip:]
        return iter(order[self.rank :: self.num_replicas])

    def state_dict(self) -> dict[str, Any]:
        """Position in the epoch, in global samples consumed by the whole job."""
        return {
            "epoch": self.epoch,
            "samples_consumed": self._consumed_batches() * self.batch_size * self.num_replicas,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_size": self._dataset_size(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the saved epoch where the job stopped on the next iteration (on any number of processes)."""
        if state.get("dataset_size") != self._dataset_size():
            raise ValueError(
                f"The checkpoint's training data had {state.get('dataset_size')} samples, this run's has "
                f"{self._dataset_size()}: the mid-epoch position cannot be restored. Resume with the same dataset."
            )
        if state.get("seed") != self.seed or state.get("shuffle") != self.shuffle:
            raise ValueError(
                f"The checkpoint's data order used seed={state.get('seed')} and shuffle={state.get('shuffle')}, this "
                f"run uses seed={self.seed} and shuffle={self.shuffle}; call `seed_everything` with the same seed."
            )
        self._resume = (int(state["epoch"]), int(state["samples_consumed"]))
