"""Exact distributed gathers for evaluation: every rank's outputs with the sampler's padding dropped.

Modules: ``api`` (the gathers, ``track``), ``accounting`` (which samples are real), ``collective`` (the one
all-gather in which the ranks also agree), ``tree`` (nested inputs as leaves), ``wire`` (bytes on the wire),
``padding`` (``pad_across_processes``), ``window`` (several batches per gather), ``metrics`` (exact metrics per
dataloader: ``LoaderMetrics``, ``exact_metrics``), ``sharding`` (``shard_iterable``).
"""

from __future__ import annotations

from lightspeed.core.gather.accounting import GatherState, current_state
from lightspeed.core.gather.api import end_of_dataloader, gather_for_metrics, gather_object, track
from lightspeed.core.gather.collective import fail_gather
from lightspeed.core.gather.metrics import LoaderMetrics, exact_metrics
from lightspeed.core.gather.padding import pad_across_processes
from lightspeed.core.gather.sharding import ShardedIterable, shard_iterable

__all__ = [
    "GatherState",
    "LoaderMetrics",
    "ShardedIterable",
    "current_state",
    "end_of_dataloader",
    "exact_metrics",
    "fail_gather",
    "gather_for_metrics",
    "gather_object",
    "pad_across_processes",
    "shard_iterable",
    "track",
]
