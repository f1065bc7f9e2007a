"""Sample accounting for distributed evaluation: which samples a rank produces are real and which are padding.

A distributed sampler pads the dataset so that every rank gets the same number of samples; the padded samples
are duplicates. The number of duplicates is known from the sampler and the dataset, never guessed from tensor
shapes. :class:`GatherState` records, for one evaluation dataloader on one rank, how many of the samples this
rank produces are real and where the current batch starts, so that :func:`lightspeed.gather_for_metrics` can drop
exactly the padding.

The rules (what counts as real, and in which order gathered samples come back):

* **DistributedSampler** (also Lightning's ``DistributedSamplerWrapper`` / ``UnrepeatedDistributedSampler``):
  the sampler lays out ``total_size`` positions, rank ``r`` takes positions ``r, r + W, r + 2W, ...``; position
  ``p`` is real when ``p < len(dataset)`` (``drop_last=True`` drops the tail instead: every position is real and
  the dropped samples are never evaluated). Gathered samples come back in the sampler's global order, which is
  dataset order when ``shuffle=False``.
* **IterableDataset with ``__len__``**: ``len(dataset)`` is the true number of samples over *all* ranks (every
  rank must report the same value), and the dataset shards round-robin (sample ``i`` on rank ``i % W``, the layout
  ``DistributedSampler`` and ``datasets.distributed.split_dataset_by_node`` use). A shard may pad at its end so
  every rank runs the same number of batches; whatever a rank yields beyond its
  ``len(range(rank, len(dataset), W))`` real samples is padding and is dropped. Order: the dataset's order.
* **IterableDataset without ``__len__``**: nothing pads it, so every sample a rank yields is real; ranks may
  yield different numbers of samples (ragged last batches are fine). Order: rank by rank.
* **Map-style dataset without a distributed sampler** (e.g. ``use_distributed_sampler=False`` with a per-rank
  ``Subset``): every sample is real and taken as that rank's shard. If every rank iterates the whole dataset,
  the gathered result holds ``world_size`` copies; that is the data the ranks produced.

In these last two layouts (:attr:`GatherState.batches_may_differ`) the ranks may also run different numbers of
batches: the gathers compare only which call each rank is in, not its batch number, so one gather of everything after
the loop (or at the end of the epoch) works, while a gather per batch still meets a rank that has finished (a
``CallSiteMismatchError`` on every rank).

**Where the DistributedSampler is found** (:func:`find_distributed_sampler`): anywhere in the chain of samplers and
batch samplers the dataloader draws from, through the attributes ``sampler``, ``batch_sampler``,
``_batch_sampler``, ``base_sampler`` and ``_sampler`` (torch's ``BatchSampler``, Lightning's index wrappers,
Accelerate-style ``BatchSamplerShard`` / ``SkipBatchSampler`` wrappers, a user's own batch sampler), e.g.
``DataLoader(ds, batch_size=None, sampler=BatchSampler(DistributedSampler(ds), 4, False))``. When the loader's
items are made by a torch ``BatchSampler`` directly over that sampler (the loader's own batching, or a
``BatchSampler`` given as ``sampler=`` with ``batch_size=None``), the size of every item is known from it
(:meth:`GatherState.item_size`) and used instead of counting the samples in the batch.

**Replicated streams**: a dataloader without a DistributedSampler (an IterableDataset, or a map-style dataset
without a sampler) on several ranks must hold a different shard on each. Its first batch's content is
fingerprinted (:func:`batch_fingerprint`: the bytes of its first rows, or 0 when those rows are all identical or
fewer than two) and the fingerprint rides in the first collective of the epoch; when every rank's fingerprint is
the same and non-zero, every rank yields the same data and a :class:`GatherError` says so on every rank
(:func:`lightspeed.shard_iterable` shards a stream; a dataset it wrapped is not checked).

Per-batch gathers use the position of the current batch (``begin_batch`` is called once per batch, however many
gathers the batch makes); a gather of everything a rank produced in the epoch (rows equal to the samples seen so
far) starts at position 0.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DistributedSampler, IterableDataset

from lightspeed.core.common.batch import count_samples

Layout = Literal["strided", "shards"]


@dataclass
class GatherState:
    """Evaluation progress of one dataloader on this rank, and how many of its samples are real.

    ``real_samples`` is the number of real samples this rank produces (``None``: all of them are real);
    ``total_samples`` the number over all ranks when known. ``seen`` counts the samples consumed so far in the
    epoch; ``batch_start`` / ``batch_size`` locate the current batch among them.
    """

    layout: Layout
    rank: int
    world_size: int
    real_samples: int | None
    total_samples: int | None
    source: str = "explicit"
    name: str = "dataloader 0"
    seen: int = 0
    batches: int = 0
    batch_start: int = 0
    batch_size: int | None = None
    max_batch_size: int = 0
    from_iterable_len: bool = field(default=False, repr=False)
    drop_last_batches: bool = field(default=False, repr=False)
    real_total: int | None = None  # real samples over all ranks, set by end_of_dataloader
    #: (batch size, samples of this rank, drop_last) of the torch BatchSampler that makes the loader's items, if any
    item_sizes: tuple[int, int, bool] | None = field(default=None, repr=False)
    #: rows of gathered data must be the current batch or everything so far (a state read from a dataloader)
    strict_rows: bool = field(default=False, repr=False)
    #: fingerprint the first batch to detect a stream that every rank iterates whole (no DistributedSampler)
    check_replicated: bool = field(default=False, repr=False)
    dataset_kind: str = field(default="", repr=False)
    fingerprint: int = field(default=0, repr=False)  # of this epoch's first batch (0: none or trivial)
    fingerprint_sent: bool = field(default=False, repr=False)
    #: a problem found locally outside a collective (e.g. by ``track``); raised on every rank at the next gather
    problem: str | None = field(default=None, repr=False)
    #: ranks that read the same rows (a sequence-parallel group); ``rank`` / ``world_size`` count the groups then
    ranks_per_replica: int = field(default=1, repr=False)
    #: whether this rank's samples count: only the first rank of a group of ``ranks_per_replica`` sends its rows
    contributes: bool = field(default=True, repr=False)

    # construction ---------------------------------------------------------------------------------------------

    @classmethod
    def strided(
        cls, total_samples: int, rank: int | None = None, world_size: int | None = None, **kw: Any
    ) -> GatherState:
        """Round-robin layout over ``total_samples`` real samples (DistributedSampler without ``drop_last``)."""
        rank, world_size = _rank_and_world(rank, world_size)
        return cls("strided", rank, world_size, len(range(rank, total_samples, world_size)), total_samples, **kw)

    @classmethod
    def shards(
        cls, real_samples: int | None = None, rank: int | None = None, world_size: int | None = None, **kw: Any
    ) -> GatherState:
        """Every rank owns a shard; its first ``real_samples`` samples are real (``None``: all of them)."""
        rank, world_size = _rank_and_world(rank, world_size)
        return cls("shards", rank, world_size, real_samples, None, **kw)

    @classmethod
    def from_dataloader(
        cls,
        dataloader: Iterable[Any],
        rank: int | None = None,
        world_size: int | None = None,
        name: str = "dataloader 0",
        ranks_per_replica: int | None = None,
    ) -> GatherState:
        """Read the sampler and dataset of ``dataloader`` (see the module docstring for the rules). With
        ``ranks_per_replica > 1`` (sequence parallelism) each group of that many consecutive ranks reads the same rows:
        the layout is read over the groups and only each group's first rank contributes its samples (``None``: the
        ``lightspeed_sequence_parallel`` a Fabric loader carries says, else 1)."""
        rank, world_size = _rank_and_world(rank, world_size)
        if ranks_per_replica is None:
            ranks_per_replica = getattr(getattr(dataloader, "lightspeed_sequence_parallel", None), "size", 1)
        if ranks_per_replica < 1 or world_size % ranks_per_replica:
            raise ValueError(f"{name}: {world_size} ranks do not split into groups of {ranks_per_replica}.")
        replica, replicas = rank // ranks_per_replica, world_size // ranks_per_replica
        if ranks_per_replica > 1:
            _check_group_sampler(dataloader, name, replica, replicas, ranks_per_replica)
        state = cls._from_dataloader(dataloader, replica, replicas, name)
        state.ranks_per_replica, state.contributes = ranks_per_replica, rank % ranks_per_replica == 0
        state.drop_last_batches = bool(getattr(dataloader, "drop_last", False))
        state.item_sizes = _item_sizes(dataloader)
        if state.item_sizes is not None:
            state.drop_last_batches = state.item_sizes[2]
        state.strict_rows = True
        return state

    @classmethod
    def _from_dataloader(
        cls, dataloader: Iterable[Any], rank: int | None, world_size: int | None, name: str
    ) -> GatherState:
        rank, world_size = _rank_and_world(rank, world_size)
        dataset = getattr(dataloader, "dataset", None)
        sampler = find_distributed_sampler(dataloader)
        if sampler is not None:
            if sampler.num_replicas != world_size:
                raise ValueError(
                    f"{name}: its DistributedSampler splits the data over num_replicas={sampler.num_replicas} ranks "
                    f"but the process group has {world_size}; create the sampler with num_replicas={world_size} "
                    "(or let Lightning inject it)."
                )
            length = len(sampler.dataset)  # type: ignore[arg-type]
            real_positions = min(length, int(sampler.total_size))
            source = (
                f"{type(sampler).__name__}(len={length}, world_size={world_size}, "
                f"drop_last={bool(getattr(sampler, 'drop_last', False))}, "
                f"shuffle={bool(getattr(sampler, 'shuffle', False))})"
            )
            real_samples = len(range(sampler.rank, real_positions, world_size))
            return cls("strided", sampler.rank, world_size, real_samples, real_positions, source=source, name=name)
        check = world_size > 1 and dataset is not None and not getattr(dataset, "lightspeed_sharded", False)
        if isinstance(dataset, IterableDataset):
            total = _len_or_none(dataset)
            if total is None:
                source = f"{type(dataset).__name__} without __len__"
                state = cls("shards", rank, world_size, None, None, source=source, name=name)
            else:
                source = f"{type(dataset).__name__}(len={total}), round-robin shards"
                state = cls.strided(total, rank, world_size, source=source, name=name)
                state.from_iterable_len = True
            state.check_replicated, state.dataset_kind = check, "iterable"
            return state
        if world_size > 1 and dataset is not None:
            warn_once(
                f"lightspeed.gather_for_metrics: {name} has a map-style dataset but no DistributedSampler; every "
                "sample a rank loads is taken as real (the ranks are assumed to hold disjoint shards). If every rank "
                "iterates the whole dataset, the gathered result holds world_size copies."
            )
        source = "map-style dataset without DistributedSampler"
        state = cls("shards", rank, world_size, None, None, source=source, name=name)
        state.check_replicated, state.dataset_kind = check, "map"
        return state

    @property
    def batches_may_differ(self) -> bool:
        """Whether ranks may run different numbers of batches of this dataloader: shards in which every sample is real
        (no DistributedSampler and no total length to pad to), so the gathers compare no batch numbers, only which call
        each rank is in."""
        return self.layout == "shards" and self.real_samples is None

    # progress -------------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Start a new epoch."""
        self.seen = self.batches = self.batch_start = self.max_batch_size = 0
        self.batch_size = self.real_total = None
        self.fingerprint, self.fingerprint_sent, self.problem = 0, False, None

    def item_size(self, batch: Any) -> int:
        """Samples in the next item of the dataloader: from its torch BatchSampler when known (see the module
        docstring), else counted in ``batch`` (:func:`batch_size_of`)."""
        if self.item_sizes is not None:
            batch_size, samples, drop_last = self.item_sizes
            full, rest = divmod(samples, batch_size)
            if self.batches < full:
                return batch_size
            if self.batches == full and rest and not drop_last:
                return rest
            return 0
        return batch_size_of(batch)

    def begin_item(self, batch: Any) -> None:
        """Record that this rank now evaluates ``batch``, the next item of the dataloader the state was read from
        (what ``track`` and the ``GatherForMetrics`` callback call once per batch): its size, and for the first
        batch of a dataloader without a DistributedSampler, its fingerprint."""
        if self.batches == 0 and self.check_replicated:
            self.fingerprint = batch_fingerprint(batch)
        self.begin_batch(self.item_size(batch))

    def take_fingerprint(self) -> int:
        """The first batch's fingerprint for this rank's first collective of the epoch (0 afterwards)."""
        if self.fingerprint_sent:
            return 0
        self.fingerprint_sent = True
        return self.fingerprint

    def replicated_problem(self, fingerprints: list[int]) -> str | None:
        """The error to raise on every rank when every rank's first batch is the same (see the module docstring)."""
        if len(fingerprints) < 2 or fingerprints[0] == 0 or any(f != fingerprints[0] for f in fingerprints):
            return None
        if self.dataset_kind == "iterable":
            fix = (
                "An IterableDataset must yield a different shard on each rank: wrap it with "
                "lightspeed.shard_iterable(dataset) (round-robin over ranks and DataLoader workers; give it a "
                "__len__ or length= with the total so the padding is dropped exactly), or split it by rank yourself "
                "(e.g. datasets.distributed.split_dataset_by_node)."
            )
        else:
            fix = (
                "Give the DataLoader a DistributedSampler (sampler=DistributedSampler(dataset)), or let Lightning "
                "inject one (use_distributed_sampler=True)."
            )
        return (
            f"{self.name} is not sharded across ranks: all {len(fingerprints)} ranks got the same first batch, so "
            f"every rank iterates the whole dataset and the gathered result would hold each sample "
            f"{len(fingerprints)} times. {fix}"
        )

    def begin_batch(self, batch_size: int) -> None:
        """Record that this rank now evaluates a batch of ``batch_size`` samples (once per batch)."""
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0, got {batch_size}")
        self.batch_start = self.seen
        self.batch_size = int(batch_size)
        self.seen += int(batch_size)
        self.batches += 1
        self.max_batch_size = max(self.max_batch_size, int(batch_size))

    def real_count(self, start: int, rows: int) -> int:
        """How many of ``rows`` samples at local positions ``start, start + 1, ...`` are real (none on a rank that
        does not contribute: its group's first rank sends the group's rows)."""
        if not self.contributes:
            return 0
        if self.real_samples is None:
            return rows
        return max(0, min(rows, self.real_samples - start))

    def real_mask(self) -> torch.Tensor:
        """Boolean mask over the current batch: True for real samples, False for padding.

        Use it to reduce per-rank values exactly before gathering them (e.g. ``loss[mask].sum()``).
        """
        if self.batch_size is None:
            raise RuntimeError(f"{self.name}: no batch has started yet; call begin_batch(batch_size) first.")
        mask = torch.zeros(self.batch_size, dtype=torch.bool)
        mask[: self.real_count(self.batch_start, self.batch_size)] = True
        return mask

    def start_for_rows(self, rows: int) -> int | None:
        """Local position of the first of ``rows`` gathered samples: the current batch, or the whole epoch so far.

        ``None`` when ``rows`` matches neither (the caller reports it).
        """
        if self.batch_size is not None and rows == self.batch_size:
            return self.batch_start
        if rows == self.seen:
            return 0
        return None

    def describe(self) -> str:
        """One line for cross-rank checks: every rank must count the samples of the same dataloader alike."""
        groups = f", {self.world_size} groups of {self.ranks_per_replica} ranks" if self.ranks_per_replica > 1 else ""
        return f"accounting: {self.layout}, total={self.total_samples}{groups}, {self.name}"

    @contextlib.contextmanager
    def active(self) -> Iterator[GatherState]:
        """Make this the state that :func:`gather_for_metrics` uses while the block runs."""
        previous = current_state()
        set_current_state(self)
        try:
            yield self
        finally:
            set_current_state(previous)


# the "current eval context" --------------------------------------------------------------------------------------

_CURRENT: GatherState | None = None


def current_state() -> GatherState | None:
    """The state that :func:`gather_for_metrics` uses when none is passed (set by the callback or ``track``)."""
    return _CURRENT


def set_current_state(state: GatherState | None) -> None:
    """Install ``state`` as the current evaluation state (``None`` clears it)."""
    global _CURRENT
    _CURRENT = state


# dataloaders iterated with track(), for gather_for_metrics(..., dataloader=loader) --------------------------------

_TRACKED: weakref.WeakKeyDictionary[Any, GatherState] = weakref.WeakKeyDictionary()
_TRACKED_BY_ID: dict[int, tuple[Any, GatherState]] = {}  # iterables that take no weak reference (kept: at most 8)


def register_dataloader(dataloader: Any, state: GatherState) -> None:
    """Remember ``state`` as the accounting of ``dataloader`` (``track`` does, for each iteration of it)."""
    try:
        _TRACKED[dataloader] = state
    except TypeError:
        _TRACKED_BY_ID.pop(id(dataloader), None)
        _TRACKED_BY_ID[id(dataloader)] = (dataloader, state)
        while len(_TRACKED_BY_ID) > 8:
            del _TRACKED_BY_ID[next(iter(_TRACKED_BY_ID))]


def state_for_dataloader(dataloader: Any) -> GatherState | None:
    """The state of the latest ``track`` of ``dataloader`` (None: it was never iterated with ``track``)."""
    try:
        found = _TRACKED.get(dataloader)
    except TypeError:
        found = None
    if found is not None:
        return found
    entry = _TRACKED_BY_ID.get(id(dataloader))
    return entry[1] if entry is not None and entry[0] is dataloader else None


# helpers -------------------------------------------------------------------------------------------------------


def batch_size_of(batch: Any) -> int:
    """Samples in a dataloader batch, by ``count_samples``, for :meth:`GatherState.begin_batch`.

    Raises ``ValueError`` when ``batch`` has no sample dimension, since the caller must then give the size itself.
    """
    samples = count_samples(batch)
    if samples is None:
        kind = "0-d tensor" if isinstance(batch, torch.Tensor) else type(batch).__name__
        raise ValueError(f"cannot infer a batch size from a {kind}; call GatherState.begin_batch(n) yourself.")
    return samples


#: attributes through which samplers and batch samplers are found (in this order, breadth first)
SAMPLER_ATTRIBUTES = ("sampler", "batch_sampler", "_batch_sampler", "base_sampler", "_sampler")
_MAX_DEPTH = 8


def find_distributed_sampler(dataloader: Any) -> DistributedSampler | None:
    """The DistributedSampler a dataloader draws from, if any: the nearest one found breadth first through any
    nesting of samplers and batch samplers, following :data:`SAMPLER_ATTRIBUTES` (``sampler``, ``batch_sampler``,
    ``_batch_sampler``, ``base_sampler``, ``_sampler``) from the dataloader.

    A DistributedSampler that shards what another one yields (Lightning's ``DistributedSamplerWrapper`` around a
    batch sampler that holds a DistributedSampler already: ``use_distributed_sampler=True`` over such a loader)
    shards the data twice; that raises a ``ValueError``.
    """
    found = _walk_samplers(dataloader)
    if found is None:
        return None
    inner = getattr(getattr(found, "dataset", None), "_sampler", None)  # Lightning's _DatasetSamplerWrapper
    if inner is not None and _walk_samplers(inner, include_root=True) is not None:
        raise ValueError(
            f"the dataloader's {type(found).__name__} wraps a sampler that holds a DistributedSampler already, so "
            "the data is sharded twice; in Lightning pass Trainer(use_distributed_sampler=False) when your "
            "dataloader brings its own DistributedSampler."
        )
    return found


def _walk_samplers(root: Any, include_root: bool = False) -> DistributedSampler | None:
    level, visited = [root], {id(root)}
    if include_root and isinstance(root, DistributedSampler):
        return root
    for _ in range(_MAX_DEPTH):
        following = []
        for obj in level:
            for name in SAMPLER_ATTRIBUTES:
                child = getattr(obj, name, None)
                if child is None or id(child) in visited or isinstance(child, (int, float, str, bool)):
                    continue
                if isinstance(child, DistributedSampler):
                    return child
                visited.add(id(child))
                following.append(child)
        if not following:
            return None
        level = following
    return None


def _item_sizes(dataloader: Any) -> tuple[int, int, bool] | None:
    """(batch size, samples, drop_last) of the torch BatchSampler that makes the loader's items directly over a
    DistributedSampler: the loader's own batch sampler, or a BatchSampler given as ``sampler=`` with
    ``batch_size=None``. None otherwise (a custom batch sampler may yield any sizes)."""
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if batch_sampler is None and getattr(dataloader, "batch_size", 0) is None:
        batch_sampler = getattr(dataloader, "sampler", None)
    if type(batch_sampler) is not BatchSampler or not isinstance(batch_sampler.sampler, DistributedSampler):
        return None
    size = batch_sampler.batch_size
    if not isinstance(size, int) or size <= 0:
        return None
    return size, len(batch_sampler.sampler), bool(batch_sampler.drop_last)


#: rows of the first batch that its fingerprint covers
FINGERPRINT_ROWS = 16


def batch_fingerprint(batch: Any) -> int:
    """A checksum of the content of the first rows of ``batch`` (at most :data:`FINGERPRINT_ROWS`), or 0 when it
    tells nothing: fewer than two rows, or the rows all equal (constant data may legitimately match across ranks).

    Tensors count by their bytes, lists of per-sample objects by their ``repr``; other leaves are ignored.
    """
    crc, varied = 0, False
    for value in _fingerprint_leaves(batch):
        if isinstance(value, torch.Tensor):
            if value.ndim == 0 or value.is_nested or value.shape[0] < 2:
                continue
            rows = value[:FINGERPRINT_ROWS].detach().cpu().contiguous()
            varied = varied or not bool((rows == rows[:1]).all())
            crc = zlib.crc32(rows.reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
        elif len(value) >= 2:
            items = [repr(item) for item in value[:FINGERPRINT_ROWS]]
            varied = varied or len(set(items)) > 1
            crc = zlib.crc32("\x00".join(items).encode(), crc)
    if not varied:
        return 0
    return (crc & 0x7FFFFFFF) or 1


def _fingerprint_leaves(batch: Any, depth: int = 0) -> Iterator[Any]:
    if depth > 16:
        return
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _fingerprint_leaves(value, depth + 1)
    elif isinstance(batch, (list, tuple)):
        if any(isinstance(item, (torch.Tensor, Mapping, list, tuple)) for item in batch):
            for value in batch:
                yield from _fingerprint_leaves(value, depth + 1)
        else:
            yield batch


def _check_group_sampler(dataloader: Iterable[Any], name: str, replica: int, replicas: int, size: int) -> None:
    """Under sequence parallelism the rows are split over the groups of ``size`` ranks: the sampler must say so."""
    sampler = find_distributed_sampler(dataloader)
    if sampler is None:
        raise ValueError(
            f"{name} has no DistributedSampler, and with sequence_parallel_size={size} lightspeed counts the samples "
            "of each data-parallel group from its sampler: let the strategy inject one (use_distributed_sampler=True "
            "in the Trainer, use_distributed_sampler in Fabric's setup_dataloaders) or give it "
            f"DistributedSampler(dataset, num_replicas={replicas}, rank={replica})."
        )
    if (sampler.num_replicas, sampler.rank) != (replicas, replica):
        raise ValueError(
            f"{name}: its DistributedSampler has num_replicas={sampler.num_replicas}, rank={sampler.rank}, but with "
            f"sequence_parallel_size={size} this rank is in data-parallel group {replica} of {replicas}: create it "
            f"with num_replicas={replicas}, rank={replica} (or let the strategy inject it)."
        )


@functools.lru_cache(maxsize=4)  # the leaves of one gather share their counts: one permutation for all of them
def global_order(valid: tuple[int, ...], start: tuple[int, ...], world: int) -> torch.Tensor:
    """Permutation that puts rank-major gathered rows into global sampler order (position * world + rank).

    ``valid`` and ``start`` are, per rank, the real rows gathered and the local position of the first of them.
    """
    if len(set(start)) == 1:  # the usual case: position by position, rank by rank, skipping ranks that ran out
        offsets = torch.tensor([0, *valid[:-1]], dtype=torch.int64).cumsum(0)
        steps = torch.arange(max(valid, default=0), dtype=torch.int64)
        grid = offsets[None, :] + steps[:, None]  # [position, rank] -> row in the rank-major concatenation
        present = steps[:, None] < torch.tensor(valid, dtype=torch.int64)[None, :]
        return grid[present]
    keys = torch.cat(
        [
            (torch.arange(v, dtype=torch.int64) + s) * world + r
            for r, (v, s) in enumerate(zip(valid, start, strict=True))
        ]
    )
    return torch.argsort(keys, stable=True)


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """Warn with ``message`` the first time only (a gather can run once per batch)."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, UserWarning, stacklevel=3)


def _len_or_none(obj: Any) -> int | None:
    if not hasattr(type(obj), "__len__"):
        return None
    try:
        return len(obj)
    except (TypeError, NotImplementedError):
        return None


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    initialized = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    if world_size is None:
        world_size = dist.get_world_size() if initialized else 1
    return rank, world_size


__all__ = [
    "FINGERPRINT_ROWS",
    "SAMPLER_ATTRIBUTES",
    "GatherState",
    "Layout",
    "batch_fingerprint",
    "batch_size_of",
    "current_state",
    "find_distributed_sampler",
    "state_for_dataloader",
    "register_dataloader",
    "global_order",
    "set_current_state",
    "warn_once",
]
