"""Gather evaluation outputs from every rank with exactly the real samples: no sampler padding, none missing.

``gather_for_metrics(data)`` takes a tensor or a nested dict/list/tuple of tensors (dim 0 = samples) and returns
the same structure holding the samples of every rank. Which samples are padding comes from the current
:class:`~lightspeed.core.gather.accounting.GatherState` (set by the ``GatherForMetrics`` callback, by
:func:`track` in a plain loop, or passed as ``state=``); see that module for the rules
for DistributedSampler, ``drop_last``, iterable datasets with and without ``__len__``.

What comes back, per leaf:

* tensor with dims: the real samples of all ranks concatenated on dim 0, in the sampler's global order (dataset
  order for a strided layout without shuffling; rank by rank for shards). Dims other than 0 must match across
  ranks: use :func:`~lightspeed.core.gather.padding.pad_across_processes` first for ragged ones. A gather per batch,
  one gather of everything a rank produced in the epoch, and one gather of several consecutive batches
  (``first_sample=``) all work.
* 0-d tensor: one value per rank, not a sample, so nothing is dropped: a tensor of shape ``[world_size]`` in rank
  order. A per-rank reduction that should exclude padding must mask it first (``GatherState.real_mask()``).
* list/tuple of non-tensors (e.g. strings): per-sample objects, de-duplicated and ordered like tensors.
* any other object: gathered as a list with one entry per rank.

Which dataloader: the current state (made current by the callback or by ``for batch in lightspeed.track(loader)``),
``state=``, or ``dataloader=loader`` (the state of the latest ``track`` of that loader: for loops over several
loaders at once). A state read from a dataloader requires the rows of every leaf to be the current batch (or
everything so far, or ``first_sample=`` rows): data from another dataloader is an error on every rank, not a wrong
number. A nested tensor (``torch.nested``) is an error naming its path, on every rank.

Without a state (no callback, no ``track``) it falls back to a plain all-gather and warns once: duplicates cannot be
dropped without knowing the sampler. On a single process (or without a process group) it returns ``data`` as is.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightspeed.core.common.distributed import is_distributed, values_by_rank
from lightspeed.core.errors import GatherError
from lightspeed.core.gather.accounting import (
    GatherState,
    current_state,
    global_order,
    register_dataloader,
    set_current_state,
    state_for_dataloader,
    warn_once,
)
from lightspeed.core.gather.collective import CallSite, agree, comm_device, fail_gather, gather_site
from lightspeed.core.gather.tree import Leaf, flatten, nested_problem
from lightspeed.core.gather.wire import narrowest_code, pack, unpack, wire_dtype

_NO_STATE_WARNING = (
    "lightspeed.gather_for_metrics found no evaluation state, so it gathers everything and cannot drop the "
    "duplicates a DistributedSampler adds: add the lightspeed.callbacks.GatherForMetrics callback to the "
    "Trainer, or iterate with lightspeed.track(dataloader) in a plain loop."
)


def gather_for_metrics(
    data: Any, state: GatherState | None = None, *, first_sample: int | None = None, dataloader: Any = None
) -> Any:
    """All-gather ``data`` from every rank, dropping the samples a distributed sampler added as padding.

    Collective: every rank must call it, the same number of times, with the same structure and dtypes; a
    mismatch raises a :class:`~lightspeed.core.errors.GatherError` on every rank naming the rank that
    differs.

    ``first_sample`` is this rank's position, among the samples it has produced this epoch, of row 0 of ``data``:
    give it to gather several consecutive batches at once (the ``GatherForMetrics`` callback does). Left out, row 0
    is the current batch's first sample when the rows match the batch, else the epoch's first sample.

    ``dataloader`` names the dataloader ``data`` came from, iterated with :func:`track` (its latest iteration's
    state is used); the rows must then be its current batch or everything so far, else every rank raises.

    Args:
        data: a tensor, or a nested dict/list/tuple of tensors, one row per sample; a list of picklable objects is
            gathered as objects.
        state: the :class:`GatherState` to use instead of the current one (``GatherForMetrics`` passes its own).
        first_sample: this rank's position of ``data``'s row 0 among the samples it produced this epoch.
        dataloader: the dataloader ``data`` came from (needed when several are iterated at once).
    """
    return gather_samples(data, state, first_sample=first_sample, dataloader=dataloader, whole=False)


def gather_samples(
    data: Any,
    state: GatherState | None = None,
    *,
    first_sample: int | None = None,
    dataloader: Any = None,
    whole: bool = True,
) -> Any:
    """:func:`gather_for_metrics` for lightspeed's own gathers; ``whole``: the caller put the slices of a
    sequence-parallel group back into whole sequences (the user's own call cannot have, and is refused there)."""
    if not is_distributed():
        return data
    if state is not None and dataloader is not None:
        raise TypeError("gather_for_metrics: pass state= or dataloader=, not both.")
    problem = None
    if dataloader is not None:
        state = state_for_dataloader(dataloader)
        if state is None:
            problem = (
                f"gather_for_metrics(dataloader=...) got a {type(dataloader).__name__} that is not being iterated "
                "with lightspeed.track; loop over it as `for batch in lightspeed.track(loader):`."
            )
    else:
        state = state if state is not None else current_state()
        if state is None:
            warn_once(_NO_STATE_WARNING)
    if not whole and state is not None and state.ranks_per_replica > 1:
        problem = problem or _SLICES_PROBLEM
    leaves, rebuild = flatten(data)
    problem = problem or (state.problem if state is not None else None) or nested_problem("gather_for_metrics", leaves)
    if problem is not None:
        fail_gather(GatherError(problem), state)
    samples, problem = _locate_real_rows(leaves, state, first_sample)
    sent = _tensors_to_send(leaves, samples)
    per_rank, raw = _exchange(leaves, samples, sent, state, problem)
    _check_gathered(state, samples, per_rank)
    orders = _global_orders(state, per_rank)
    results = {**_unpack_tensors(sent, per_rank, orders, raw), **_gather_objects(leaves, samples, orders)}
    return rebuild([results[index] for index in range(len(leaves))])


_SLICES_PROBLEM = (
    "with sequence_parallel_size > 1 each rank's step holds a slice of every sequence, which "
    "gathered as samples would be counted as whole ones. Return per-token predictions and targets of the slice to "
    "GatherForMetrics (or from exact_metrics' step), which put the slices back together first."
)


def gather_object(obj: Any) -> list[Any]:
    """Gather one picklable object from every rank: a list with one entry per rank, in rank order.

    No de-duplication (use :func:`gather_for_metrics` with a list for per-sample objects). On a single process:
    ``[obj]``.

    Args:
        obj: any picklable object.
    """
    if not is_distributed():
        return [obj]
    agree("gather_object", ["object"], (CallSite.OBJECT, 0), "gather_object")
    return values_by_rank(obj)


def track(dataloader: Iterable[Any], state: GatherState | None = None) -> Iterator[Any]:
    """Iterate ``dataloader`` in a plain PyTorch loop with its :class:`GatherState` current, for gathers inside.

    ``for x, y in lightspeed.track(loader): gather_for_metrics(model(x))`` drops the sampler's duplicates without
    Lightning. The state is read from the dataloader unless one is given, and is also found by
    ``gather_for_metrics(..., dataloader=loader)``. When the loop runs out, every rank checks that the others ran the
    same number of batches (:func:`end_of_dataloader`; shards without padding may differ); the state stays current
    afterwards, so one gather of everything the loop produced also works.

    Args:
        dataloader: this rank's dataloader (its sampler tells which samples are padding).
        state: the :class:`GatherState` to make current instead of the one read from ``dataloader``.
    """
    state = state if state is not None else GatherState.from_dataloader(dataloader)
    state.reset()
    register_dataloader(dataloader, state)
    set_current_state(state)
    for batch in dataloader:
        try:
            state.begin_item(batch)
        except ValueError as err:  # raised on every rank at the next gather, not here alone
            state.problem = state.problem or f"{state.name}: {err}"
            state.begin_batch(0)
        set_current_state(state)
        yield batch
    end_of_dataloader(state)


def end_of_dataloader(state: GatherState, complete: bool = True) -> int:
    """Collective check at the end of a dataloader: every rank ran the same number of batches (except for shards whose
    every sample is real, :attr:`GatherState.batches_may_differ`: a rank that ran fewer batches has fewer samples).

    Returns the number of real samples all ranks produced. With ``complete=True`` (the loop was not cut short)
    an IterableDataset with ``__len__`` must have yielded all ``len(dataset)`` real samples; otherwise its shards
    are not round-robin or ``__len__`` is not the total over all ranks, and a :class:`GatherError` says so.
    """
    own_real = state.real_count(0, state.seen)
    if not is_distributed():
        state.real_total = own_real
        return own_real
    site_text = f"the end of {state.name} after {state.batches} batches"
    counts, _ = agree(
        "gather_for_metrics",
        [state.describe()],
        (CallSite.END, 0 if state.batches_may_differ else state.batches),
        site_text,
        state.problem,
        payload=[state.seen, own_real, state.take_fingerprint()],
    )
    replicated = state.replicated_problem([fingerprint for _, _, fingerprint in counts])
    if replicated is not None:
        raise GatherError(f"gather_for_metrics: {replicated}")
    real_total = sum(real for _, real, _ in counts)
    if complete and state.from_iterable_len and not state.drop_last_batches and state.total_samples is not None:
        if real_total != state.total_samples:
            yielded = ", ".join(f"rank {r}: {seen}" for r, (seen, _, _) in enumerate(counts))
            raise GatherError(
                f"{state.name}: len(dataset) is {state.total_samples}, but the ranks yielded {yielded} samples, of "
                f"which {real_total} count as real under round-robin sharding. lightspeed reads len() of an "
                "IterableDataset as the number of samples over all ranks, with sample i on rank i % world_size and "
                "any padding at the end of each shard; make the dataset follow that, or drop __len__ if the shards "
                "do not pad."
            )
    state.real_total = real_total
    return real_total


# the steps of gather_for_metrics ---------------------------------------------------------------------------------


@dataclass
class _LocalRows:
    """One leaf with a sample dimension as this rank holds it: where its rows sit among the samples this rank
    produced this epoch, and how many of them are real (the rest is the sampler's padding)."""

    index: int  # position among the data's leaves
    leaf: Leaf
    start: int
    valid: int

    @property
    def real(self) -> Any:
        """The real rows (or per-sample objects) of the leaf."""
        return self.leaf.value[: self.valid]

    @functools.cached_property
    def code(self) -> int:
        """The wire code the real rows of a tensor leaf travel as (0 for objects)."""
        return narrowest_code(self.real) if self.leaf.kind == "tensor" else 0


@dataclass
class _RankRows:
    """One leaf with a sample dimension as every rank described it in its header: real rows, first position, wire
    code and trailing dims, each per rank (objects: code 0, no dims)."""

    valid: list[int]
    start: list[int]
    codes: list[int]
    dims: list[list[int]]


def _locate_real_rows(
    leaves: Sequence[Leaf], state: GatherState | None, first_sample: int | None
) -> tuple[list[_LocalRows], str | None]:
    """Each rank decides locally which of its rows are real and where they sit in its sample stream.

    Returns the leaves with samples, and a problem to raise on every rank when rows cannot be placed.
    """
    located: list[_LocalRows] = []
    problem = None
    for index, leaf in enumerate(leaves):
        rows = leaf.rows
        if rows is None:
            continue
        start, valid = 0, rows
        if state is not None:
            found = state.start_for_rows(rows) if first_sample is None else _explicit_start(first_sample, rows, state)
            if found is None:
                problem = problem or _unplaced_rows_problem(leaf.path, rows, state, first_sample)
            start = found if found is not None else 0
            valid = state.real_count(start, rows)
        located.append(_LocalRows(index, leaf, start, valid))
    return located, problem


def _explicit_start(first_sample: int, rows: int, state: GatherState) -> int | None:
    return first_sample if 0 <= first_sample and first_sample + rows <= state.seen else None


def _unplaced_rows_problem(path: str, rows: int, state: GatherState, first_sample: int | None) -> str | None:
    """Why ``rows`` samples cannot be placed among this rank's samples (None: a shard's rows start at 0)."""
    if first_sample is not None:
        return (
            f"{path} has {rows} samples starting at first_sample={first_sample}, but this rank has "
            f"produced {state.seen} samples of {state.name} so far; first_sample must be >= 0 and the rows "
            "must end within the samples produced."
        )
    if state.layout == "strided" or state.strict_rows:
        return (
            f"{path} has {rows} samples on dim 0, but the current batch of {state.name} has "
            f"{state.batch_size} and this rank has produced {state.seen} in total; gather_for_metrics drops "
            "padding along dim 0, so dim 0 must be the batch (a per-batch gather) or everything gathered so far "
            "this epoch (one gather at the end). Move the sample dimension first, and gather data of the batch "
            "that the tracked dataloader yielded (pass dataloader= when several are iterated)."
        )
    return None


def _tensors_to_send(leaves: Sequence[Leaf], located: Sequence[_LocalRows]) -> list[tuple[int, torch.Tensor, int]]:
    """This rank's tensors that travel in the collective, as (leaf index, tensor, wire code), in leaf order: the
    real rows of every tensor leaf, and every 0-d tensor as one row."""
    by_index = {rows.index: rows for rows in located}
    sent: list[tuple[int, torch.Tensor, int]] = []
    for index, leaf in enumerate(leaves):
        if leaf.kind == "tensor":
            sent.append((index, by_index[index].real, by_index[index].code))
        elif leaf.kind == "scalar":
            sent.append((index, leaf.value.reshape(1), 0))
    return sent


def _exchange(
    leaves: Sequence[Leaf],
    located: Sequence[_LocalRows],
    sent: Sequence[tuple[int, torch.Tensor, int]],
    state: GatherState | None,
    problem: str | None,
) -> tuple[dict[int, _RankRows], list[torch.Tensor] | None]:
    """The one collective: every rank's structure, call site, problem and row counts, with its tensors' bytes.

    Returns every rank's rows per leaf with samples (by leaf index) and every rank's packed tensor bytes.
    """
    site = gather_site(state)
    site_text = (
        f"gather_for_metrics in batch {state.batches} of {state.name}" if state is not None else "gather_for_metrics"
    )
    signature = [leaf.describe() for leaf in leaves] + ([] if state is None else [state.describe()])
    wire = [tensor.to(wire_dtype(code, tensor.dtype)) for _, tensor, code in sent]
    fingerprint = state.take_fingerprint() if state is not None else 0
    infos, raw = agree(
        "gather_for_metrics",
        signature,
        site,
        site_text,
        problem,
        [*_header(located), fingerprint],
        data=pack(wire, comm_device()),
    )
    replicated = state.replicated_problem([info[-1] for info in infos]) if state is not None else None
    if replicated is not None:  # every rank sees the same fingerprints: every rank raises
        raise GatherError(f"gather_for_metrics: {replicated}")
    return _split_header(located, infos), raw


def _header(located: Sequence[_LocalRows]) -> list[int]:
    """Per leaf with samples: real rows and first position, and for tensors the wire code and trailing dims."""
    ints: list[int] = []
    for rows in located:
        ints += [rows.valid, rows.start]
        if rows.leaf.kind == "tensor":
            ints += [rows.code, *rows.leaf.value.shape[1:]]
    return ints


def _split_header(located: Sequence[_LocalRows], infos: list[list[int]]) -> dict[int, _RankRows]:
    """Every rank's header ints (see :func:`_header`) cut back into one :class:`_RankRows` per leaf with samples."""
    out, offset = {}, 0
    for rows in located:
        tensor = rows.leaf.kind == "tensor"
        width = 2 + rows.leaf.value.ndim if tensor else 2
        chunks = [info[offset : offset + width] for info in infos]
        out[rows.index] = _RankRows(
            valid=[c[0] for c in chunks],
            start=[c[1] for c in chunks],
            codes=[c[2] if tensor else 0 for c in chunks],
            dims=[c[3:] for c in chunks],
        )
        offset += width
    return out


def _check_gathered(
    state: GatherState | None, located: Sequence[_LocalRows], per_rank: Mapping[int, _RankRows]
) -> None:
    """Raise, on every rank alike, for what only the ranks' headers together show."""
    _check_trailing_dims(located, per_rank)
    if state is not None and state.layout == "strided" and state.from_iterable_len:
        _check_not_all_padding(state, located, per_rank)


def _check_trailing_dims(located: Sequence[_LocalRows], per_rank: Mapping[int, _RankRows]) -> None:
    for rows in located:
        dims = per_rank[rows.index].dims
        if rows.leaf.kind != "tensor" or all(d == dims[0] for d in dims):
            continue
        bad = next(r for r, d in enumerate(dims) if d != dims[0])
        axis = next(i for i, (a, b) in enumerate(zip(dims[0], dims[bad], strict=True)) if a != b) + 1
        raise GatherError(
            f"gather_for_metrics: {rows.leaf.path} has shape [n, {', '.join(map(str, dims[bad]))}] on rank {bad} but "
            f"[n, {', '.join(map(str, dims[0]))}] on rank 0; only dim 0 may differ. Pad it first: "
            f"lightspeed.pad_across_processes(tensor, dim={axis}, pad_index=...)."
        )


def _check_not_all_padding(
    state: GatherState, located: Sequence[_LocalRows], per_rank: Mapping[int, _RankRows]
) -> None:
    for rows in located:
        if sum(per_rank[rows.index].valid) == 0 and rows.leaf.rows:
            raise GatherError(
                f"gather_for_metrics: in batch {state.batches} of {state.name} every sample on every rank counts as "
                f"padding (len(dataset) = {state.total_samples} over {state.world_size} ranks). lightspeed reads "
                "len() of an IterableDataset as the number of samples over all ranks, sharded round-robin; if your "
                "__len__ returns the per-rank count, return the total instead (or drop __len__ if the shards do not "
                "pad)."
            )


def _global_orders(state: GatherState | None, per_rank: Mapping[int, _RankRows]) -> dict[int, torch.Tensor]:
    """Per leaf with samples, the permutation into the sampler's global order (none: shards stay rank by rank)."""
    if state is None or state.layout != "strided":
        return {}
    world = dist.get_world_size()
    return {index: global_order(tuple(rows.valid), tuple(rows.start), world) for index, rows in per_rank.items()}


def _unpack_tensors(
    sent: Sequence[tuple[int, torch.Tensor, int]],
    per_rank: Mapping[int, _RankRows],
    orders: Mapping[int, torch.Tensor],
    raw: list[torch.Tensor] | None,
) -> dict[int, torch.Tensor]:
    """Every rank's tensors from the collective's bytes, widened back, joined on dim 0 and put in global order."""
    if not sent:
        return {}
    assert raw is not None  # agree returns every rank's bytes whenever there was data to send
    world = dist.get_world_size()

    def layout(index: int, local: torch.Tensor, rank: int) -> tuple[torch.dtype, int, tuple[int, ...]]:
        rows = per_rank.get(index)
        if rows is None:  # a 0-d tensor: one value per rank, sent as it is
            return local.dtype, 1, ()
        return wire_dtype(rows.codes[rank], local.dtype), rows.valid[rank], tuple(rows.dims[0])

    tensors = [unpack(raw[r], [layout(index, local, r) for index, local, _ in sent]) for r in range(world)]
    results = {}
    for slot, (index, local, _) in enumerate(sent):
        out = torch.cat([tensors[r][slot].to(local.dtype) for r in range(world)], dim=0)
        if index in orders:
            out = out.index_select(0, orders[index].to(out.device))
        results[index] = out.to(local.device)
    return results


def _gather_objects(
    leaves: Sequence[Leaf], located: Sequence[_LocalRows], orders: Mapping[int, torch.Tensor]
) -> dict[int, Any]:
    """Every rank's non-tensor leaves in one object gather (only when there are any): per-rank objects as a list
    with one entry per rank; per-sample objects de-duplicated and in global order, like tensors."""
    real = {rows.index: list(rows.real) for rows in located if rows.leaf.kind == "objects"}
    slots = [index for index, leaf in enumerate(leaves) if leaf.kind in ("object", "objects")]
    if not slots:
        return {}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [real[index] if index in real else leaves[index].value for index in slots])
    results: dict[int, Any] = {}
    for slot, index in enumerate(slots):
        per_rank = [rank_objects[slot] for rank_objects in gathered]
        if index not in real:
            results[index] = per_rank
            continue
        flat = [item for objects in per_rank for item in objects]
        if index in orders:
            flat = [flat[i] for i in orders[index].tolist()]
        original = leaves[index].value
        keep_tuple = isinstance(original, tuple) and not hasattr(original, "_fields")
        results[index] = type(original)(flat) if keep_tuple else flat
    return results


__all__ = ["end_of_dataloader", "gather_for_metrics", "gather_object", "track"]
