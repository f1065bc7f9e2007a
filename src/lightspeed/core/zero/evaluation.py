"""Evaluation under ZeRO-3 that cannot hang when the ranks run different numbers of batches.

Under ZeRO-3 every forward pass gathers each layer's parameters from all ranks, so every rank must run the same number
of forward passes. Evaluation breaks that when the ranks' shards hold different numbers of batches (a hand-made split
with ``use_distributed_sampler=False``, an IterableDataset sharded unevenly, a ``limit_val_batches`` that cuts the
shards differently): the rank that ran out leaves the others waiting in their next forward pass.

:func:`gathered_for_evaluation` first agrees on every rank's batch counts (one small object gather). Equal known counts
change nothing. When they differ, or a rank cannot count its batches (a dataloader without ``len()``), the parameters
are gathered once for the whole evaluation, as :func:`~lightspeed.core.zero.generation.gathered_for_generation` does
for a generation, so the forward passes inside make no collective and each rank runs as many as it has batches. A
model that does not fit whole (``"auto"``: more than half of some rank's free memory) with counts known to differ is an
:class:`~lightspeed.core.errors.UnevenEvaluationError` on every rank before the first forward pass; with unknown counts
it stays partitioned, with a warning.

Gathering alone is not enough: until DeepSpeed has recorded the order in which a model's modules fetch their parameters,
every forward pass starts by checking that this order is the same on every rank (a broadcast). Inside the block the
parameters are whole and nothing is fetched, so that check is skipped
(:func:`~lightspeed.core.zero.generation.forward_without_collectives`) and every coordinator a forward pass reached
records its trace afresh afterwards. Generation inside needs no ``synced_gpus`` then, and
``gathered_for_generation`` nothing more, so ``generate`` in a ``validation_step`` does not hang either.

Why gathering instead of dummy forward passes on the ranks that ran out (what HuggingFace's ``synced_gpus`` does for
generation): DeepSpeed needs the same sequence of parameter fetches on every rank, which only the model's own forward
produces, and a rank that left the evaluation loop has neither a batch to run it on nor a loop to run it in (the
Trainer's loop has ended there, its hooks with it). Gathering needs neither, and the evaluation gets faster too: one
all-gather in all instead of one per layer and batch.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from lightspeed.core.common.distributed import global_rank, values_by_rank
from lightspeed.core.errors import UnevenEvaluationError
from lightspeed.core.zero.generation import (
    GATHER_MEMORY_SHARE,
    forward_without_collectives,
    gathered_for_generation,
    partitioned_over_ranks,
    runs_without_collectives,
)

__all__ = ["batch_count", "gathered_for_evaluation"]


def batch_count(dataloader: Any) -> float:
    """The number of batches ``dataloader`` yields on this rank: a given number as it is, else ``len()``, or ``inf``
    when it has none (an IterableDataset without ``__len__``)."""
    if isinstance(dataloader, (int, float)) and not isinstance(dataloader, bool):
        return float(dataloader)
    try:
        return float(len(dataloader))
    except (TypeError, NotImplementedError):
        return math.inf


def _listing(counts: Sequence[Sequence[float]]) -> str:
    """``rank 0: 3, 1; rank 1: 2, 3`` (``?`` for a count a rank does not know)."""
    return "; ".join(
        f"rank {rank}: " + ", ".join("?" if math.isinf(n) else str(int(n)) for n in ranks)
        for rank, ranks in enumerate(counts)
    )


@contextlib.contextmanager
def gathered_for_evaluation(
    model: nn.Module, *dataloaders: Any, enabled: bool | str = "auto", what: str = "evaluation"
) -> Iterator[bool]:
    """Within the block, the forward passes of ``model`` (ZeRO-3, partitioned over several ranks) do not hang when
    the ranks run different numbers of batches of ``dataloaders`` (each a dataloader, or its number of batches on
    this rank). A collective: every rank enters it, with its own dataloaders.

    Yields whether the parameters were gathered (whole on every rank until the block ends, then partitioned again).
    ``enabled="auto"`` gathers when the ranks' batch counts differ or are unknown and the whole model takes at most
    half of every rank's free memory; ``True`` always gathers (one all-gather instead of one per layer and batch);
    ``False`` never. Counts known to differ on a model left partitioned raise :class:`UnevenEvaluationError` on every
    rank instead of hanging in a forward pass. ``what`` names the evaluation in messages. A model that is not
    partitioned over several ranks is left as it is.

    Args:
        model: the model (or the engine/module holding it) whose forward passes the block runs.
        *dataloaders: this rank's evaluation dataloaders, or their numbers of batches on this rank.
        enabled: ``"auto"``, ``True`` (always gather) or ``False`` (never).
        what: the evaluation's name in messages (``"validation"``, ``"test"``, ...).
    """
    if enabled not in (True, False, "auto"):
        raise ValueError(f'gathered_for_evaluation(enabled=...) takes True, False or "auto"; got {enabled!r}.')
    if not partitioned_over_ranks(model):
        yield False
        return
    if runs_without_collectives(model):  # inside another such block: whole already, and agreeing is a collective
        yield True
        return
    if enabled is True:
        with gathered_for_generation(model, enabled=True) as gathered, forward_without_collectives():
            yield gathered
        return
    counts = values_by_rank([batch_count(loader) for loader in dataloaders])
    if all(rank == counts[0] for rank in counts) and not any(math.isinf(n) for n in counts[0]):
        yield False  # equal known counts: the same forward passes on every rank
        return
    known = not any(math.isinf(n) for rank in counts for n in rank)
    with gathered_for_generation(model, enabled=enabled) as gathered:
        reason, other_fix = (
            ("gathering is turned off (enabled=False)", 'enabled="auto"')
            if enabled is False
            else (
                f"the whole model takes more than {GATHER_MEMORY_SHARE:.0%} of the free memory of a rank",
                "free memory for the whole model on every rank",
            )
        )
        if not gathered and known:
            raise UnevenEvaluationError(
                f"{what.capitalize()} under ZeRO-3 with a different number of batches per rank ({_listing(counts)} "
                "batches per dataloader) would hang: every forward pass gathers the parameters from all ranks, so a "
                "rank that runs out of batches leaves the others waiting in their next forward pass. lightspeed "
                f"gathers the whole model once for such an evaluation, but {reason}. Give every rank the same number "
                "of batches (a DistributedSampler, e.g. Lightning's use_distributed_sampler=True, or "
                f"lightspeed.shard_iterable(dataset, length=...) for an IterableDataset), or {other_fix}."
            )
        if not gathered and global_rank() == 0:
            warnings.warn(
                f"lightspeed: {what} under ZeRO-3 over dataloaders without a length ({_listing(counts)} batches per "
                f"dataloader) runs on the partitioned model, since {reason}: ranks that run different numbers of "
                "batches will wait for each other until the process group's timeout. Give the dataloaders a length "
                f"and every rank the same number of batches, or {other_fix}.",
                UserWarning,
                stacklevel=3,
            )
        if not gathered:
            yield False
            return
        with forward_without_collectives():
            yield True
