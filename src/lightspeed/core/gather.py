"""Gather evaluation outputs from every rank with exactly the real samples: no sampler padding, none missing.

``gather_for_metrics(data)`` takes a tensor or a nested dict/list/tuple of tensors (dim 0 = samples) and returns
the same structure holding the samples of every rank. Which samples are padding comes from the current
:class:`~lightspeed.core.gather_state.GatherState` (set by the ``GatherForMetrics`` callback, by
:func:`track` in a plain loop, or passed as ``state=``); see that module for the rules
for DistributedSampler, ``drop_last``, iterable datasets with and without ``__len__``.

What comes back, per leaf:

* tensor with dims: the real samples of all ranks concatenated on dim 0, in the sampler's global order (dataset
  order for a strided layout without shuffling; rank by rank for shards). Dims other than 0 must match across
  ranks: use :func:`pad_across_processes` first for ragged ones. A gather per batch, one gather of everything a
  rank produced in the epoch, and one gather of several consecutive batches (``first_sample=``) all work.
* 0-d tensor: one value per rank, not a sample, so nothing is dropped: a tensor of shape ``[world_size]`` in rank
  order. A per-rank reduction that should exclude padding must mask it first (``GatherState.real_mask()``).
* list/tuple of non-tensors (e.g. strings): per-sample objects, de-duplicated and ordered like tensors.
* any other object: gathered as a list with one entry per rank.

Without a state (no callback, no ``track``) it falls back to a plain all-gather and warns once: duplicates cannot be
dropped without knowing the sampler. On a single process (or without a process group) it returns ``data`` as is.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Iterable, Iterator, NoReturn, Sequence

import torch
import torch.distributed as dist

from lightspeed.core.gather_state import (
    GatherState, _warn_once, current_state, find_distributed_sampler, infer_batch_size, set_current_state,
)
from lightspeed.core.gather_sync import CallSite, GatherError, agree, comm_device, is_distributed
from lightspeed.core.gather_tree import Leaf, flatten
from lightspeed.core.gather_wire import narrowest_code, wire_dtype
from lightspeed.core.padding import pad_across_processes


def gather_for_metrics(data: Any, state: GatherState | None = None, *, first_sample: int | None = None) -> Any:
    """All-gather ``data`` from every rank, dropping the samples a distributed sampler added as padding.

    Collective: every rank must call it, the same number of times, with the same structure and dtypes; a
    mismatch raises a :class:`~lightspeed.core.gather_sync.GatherError` on every rank naming the rank that differs.

    ``first_sample`` is this rank's position, among the samples it has produced this epoch, of row 0 of ``data``:
    give it to gather several consecutive batches at once (the ``GatherForMetrics`` callback does). Left out, row 0
    is the current batch's first sample when the rows match the batch, else the epoch's first sample.
    """
    if not is_distributed():
        return data
    state = state if state is not None else current_state()
    if state is None:
        _warn_once(
            "lightspeed.gather_for_metrics found no evaluation state, so it gathers everything and cannot drop the "
            "duplicates a DistributedSampler adds: add the lightspeed.callbacks.GatherForMetrics callback to the "
            "Trainer, or iterate with lightspeed.core.gather.track(dataloader) in a plain loop."
        )
    world = dist.get_world_size()
    leaves, rebuild = flatten(data)

    # each rank decides locally which of its rows are real and where they sit in its sample stream
    starts: list[int] = []
    valids: list[int] = []
    error = None
    for leaf in leaves:
        rows = leaf.rows
        if rows is None:
            continue
        start, valid = 0, rows
        if state is not None:
            located = state.start_for_rows(rows) if first_sample is None else _explicit_start(first_sample, rows, state)
            if located is None and first_sample is not None:
                error = error or (
                    f"{leaf.path} has {rows} samples starting at first_sample={first_sample}, but this rank has "
                    f"produced {state.seen} samples of {state.name} so far; first_sample must be >= 0 and the rows "
                    "must end within the samples produced."
                )
            elif located is None and state.layout == "strided":
                error = error or (
                    f"{leaf.path} has {rows} samples on dim 0, but the current batch of {state.name} has "
                    f"{state.batch_size} and this rank has produced {state.seen} in total; gather_for_metrics drops "
                    "padding along dim 0, so dim 0 must be the batch (a per-batch gather) or everything gathered so far "
                    "this epoch (one gather at the end). Move the sample dimension first."
                )
            start = located if located is not None else 0
            valid = state.real_count(start, rows)
        starts.append(start)
        valids.append(valid)

    # per sample leaf: real rows, first position, and for tensors the wire code and trailing dims; in the header
    sample_leaves = [leaf for leaf in leaves if leaf.rows is not None]
    local_info: list[int] = []
    codes: list[int] = []  # per tensor sample leaf: the dtype its real rows travel as (gather_wire)
    for leaf, start, valid in zip(sample_leaves, starts, valids):
        local_info += [valid, start]
        if leaf.kind == "tensor":
            codes.append(narrowest_code(leaf.value[:valid]))
            local_info += [codes[-1], *leaf.value.shape[1:]]
    # this rank's real rows of every tensor leaf (and its scalars), packed as bytes into the same collective
    local_valid, local_codes = iter(valids), iter(codes)
    tensors: list[tuple[int, torch.Tensor]] = []
    wire: list[torch.Tensor] = []
    for index, leaf in enumerate(leaves):
        if leaf.kind == "tensor":
            real = leaf.value[: next(local_valid)]
            tensors.append((index, real))
            wire.append(real.to(wire_dtype(next(local_codes), real.dtype)))
        elif leaf.kind == "objects":
            next(local_valid)
        elif leaf.kind == "scalar":
            tensors.append((index, leaf.value.reshape(1)))
            wire.append(tensors[-1][1])
    site = (CallSite.GATHER, state.batches if state is not None else 0)
    site_text = f"gather_for_metrics in batch {site[1]} of {state.name}" if state is not None else "gather_for_metrics"
    accounting = [] if state is None else [f"accounting: {state.layout}, total={state.total_samples}, {state.name}"]
    infos, raw = agree(
        "gather_for_metrics", [leaf.describe() for leaf in leaves] + accounting, site, site_text, error, local_info,
        data=_pack(wire),
    )
    per_leaf = _split_infos(sample_leaves, infos)
    _check_trailing_dims(sample_leaves, per_leaf)
    if state is not None and state.layout == "strided" and state.from_iterable_len:
        _check_not_all_padding(state, sample_leaves, per_leaf)

    strided = state is not None and state.layout == "strided"
    results: dict[int, Any] = {}
    shapes: dict[int, tuple[list[int], tuple[int, ...], list[int]]] = {}  # leaf -> rows, row shape, wire code per rank
    orders: dict[int, torch.Tensor | None] = {}
    object_payload: list[Any] = []
    object_slots: list[tuple[int, str]] = []
    sample_index = 0
    for index, leaf in enumerate(leaves):
        if leaf.kind == "scalar":
            shapes[index], orders[index] = ([1] * world, (), [0] * world), None
        elif leaf.kind == "object":
            object_payload.append(leaf.value)
            object_slots.append((index, "object"))
        else:
            valid_all, start_all, codes_all, dims_all = per_leaf[sample_index]
            orders[index] = _order(tuple(valid_all), tuple(start_all), world) if strided else None
            if leaf.kind == "tensor":
                shapes[index] = (valid_all, tuple(dims_all[0]), codes_all)
            else:
                object_payload.append(list(leaf.value[: valids[sample_index]]))
                object_slots.append((index, "objects"))
            sample_index += 1
    if tensors:
        layout = [(local.dtype, *shapes[index]) for index, local in tensors]
        per_rank = [
            _unpack(raw[r], [(wire_dtype(codes[r], dtype), rows[r], shape) for dtype, rows, shape, codes in layout])
            for r in range(world)
        ]
        for slot, (index, local) in enumerate(tensors):
            out = torch.cat([per_rank[r][slot].to(local.dtype) for r in range(world)], dim=0)
            if orders[index] is not None:
                out = out.index_select(0, orders[index].to(out.device))
            results[index] = out.to(local.device)
    if object_slots:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, object_payload)
        for slot, (index, kind) in enumerate(object_slots):
            if kind == "object":
                results[index] = [gathered[r][slot] for r in range(world)]
                continue
            flat = [item for r in range(world) for item in gathered[r][slot]]
            if orders[index] is not None:
                flat = [flat[i] for i in orders[index].tolist()]
            original = leaves[index].value
            results[index] = type(original)(flat) if isinstance(original, tuple) and not hasattr(original, "_fields") else flat
    return rebuild([results[i] for i in range(len(leaves))])


def track(dataloader: Iterable[Any], state: GatherState | None = None) -> Iterator[Any]:
    """Iterate ``dataloader`` in a plain PyTorch loop with its :class:`GatherState` current, for gathers inside.

    ``for x, y in track(loader): gather_for_metrics(model(x))`` drops the sampler's duplicates without Lightning.
    The state is read from the dataloader unless one is given. When the loop runs out, every rank checks that
    the others ran the same number of batches (:func:`end_of_dataloader`); the state stays current afterwards, so
    one gather of everything the loop produced also works.
    """
    state = state if state is not None else GatherState.from_dataloader(dataloader)
    state.reset()
    set_current_state(state)
    for batch in dataloader:
        state.begin_batch(infer_batch_size(batch))
        set_current_state(state)
        yield batch
    end_of_dataloader(state)


def fail_gather(error: GatherError, state: GatherState | None = None) -> NoReturn:
    """Raise ``error`` on every rank, from inside the ``gather_for_metrics`` call that the other ranks are in.

    For a rank that cannot make its gather (e.g. a step returned no predictions): raising only here would leave
    the other ranks waiting in theirs. Instead this rank joins that collective flagged as failed, and every rank
    raises ``type(error)`` with the message, naming this rank. Without a process group it raises ``error`` as is.
    """
    if not is_distributed():
        raise error
    state = state if state is not None else current_state()
    site = (CallSite.GATHER, state.batches if state is not None else 0)
    agree("gather_for_metrics", ["failed"], site, "a failed gather_for_metrics", str(error), error_type=type(error))
    raise error  # not reached: agree raises on every rank when one reports an error


def gather_object(obj: Any) -> list[Any]:
    """Gather one picklable object from every rank: a list with one entry per rank, in rank order.

    No de-duplication (use :func:`gather_for_metrics` with a list for per-sample objects). On a single process:
    ``[obj]``.
    """
    if not is_distributed():
        return [obj]
    agree("gather_object", ["object"], (CallSite.OBJECT, 0), "gather_object")
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def end_of_dataloader(state: GatherState, complete: bool = True) -> int:
    """Collective check at the end of a dataloader: every rank ran the same number of batches.

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
        "gather_for_metrics", [f"accounting: {state.layout}, total={state.total_samples}, {state.name}"],
        (CallSite.END, state.batches), site_text, payload=[state.seen, own_real],
    )
    real_total = sum(real for _, real in counts)
    if complete and state.from_iterable_len and not state.drop_last_batches and state.total_samples is not None:
        if real_total != state.total_samples:
            yielded = ", ".join(f"rank {r}: {seen}" for r, (seen, _) in enumerate(counts))
            raise GatherError(
                f"{state.name}: len(dataset) is {state.total_samples}, but the ranks yielded {yielded} samples, of which "
                f"{real_total} count as real under round-robin sharding. lightspeed reads len() of an IterableDataset "
                "as the number of samples over all ranks, with sample i on rank i % world_size and any padding at the "
                "end of each shard; make the dataset follow that, or drop __len__ if the shards do not pad."
            )
    state.real_total = real_total
    return real_total


# internals -------------------------------------------------------------------------------------------------------

def _split_infos(sample_leaves: Sequence[Leaf], infos: list[list[int]]) -> list[tuple[list[int], list[int], list[int], list[list[int]]]]:
    """Per sample leaf: (valid, start, wire code, trailing dims), each per rank (objects: code 0, no dims)."""
    out, offset = [], 0
    for leaf in sample_leaves:
        tensor = leaf.kind == "tensor"
        width = 3 + leaf.value.ndim - 1 if tensor else 2
        chunk = [row[offset:offset + width] for row in infos]
        codes = [c[2] for c in chunk] if tensor else [0] * len(chunk)
        out.append(([c[0] for c in chunk], [c[1] for c in chunk], codes, [c[3:] if tensor else [] for c in chunk]))
        offset += width
    return out


def _explicit_start(first_sample: int, rows: int, state: GatherState) -> int | None:
    return first_sample if 0 <= first_sample and first_sample + rows <= state.seen else None


def _check_trailing_dims(sample_leaves: Sequence[Leaf], per_leaf: Sequence[tuple]) -> None:
    for leaf, (_, _, _, dims) in zip(sample_leaves, per_leaf):
        if leaf.kind != "tensor" or all(d == dims[0] for d in dims):
            continue
        bad = next(r for r, d in enumerate(dims) if d != dims[0])
        axis = next(i for i, (a, b) in enumerate(zip(dims[0], dims[bad])) if a != b) + 1
        raise GatherError(
            f"gather_for_metrics: {leaf.path} has shape [n, {', '.join(map(str, dims[bad]))}] on rank {bad} but "
            f"[n, {', '.join(map(str, dims[0]))}] on rank 0; only dim 0 may differ. Pad it first: "
            f"lightspeed.pad_across_processes(tensor, dim={axis}, pad_index=...)."
        )


def _check_not_all_padding(state: GatherState, sample_leaves: Sequence[Leaf], per_leaf: Sequence[tuple]) -> None:
    for leaf, (valid_all, _, _, _) in zip(sample_leaves, per_leaf):
        if sum(valid_all) == 0 and leaf.rows:
            raise GatherError(
                f"gather_for_metrics: in batch {state.batches} of {state.name} every sample on every rank counts as "
                f"padding (len(dataset) = {state.total_samples} over {state.world_size} ranks). lightspeed reads "
                "len() of an IterableDataset as the number of samples over all ranks, sharded round-robin; if your "
                "__len__ returns the per-rank count, return the total instead (or drop __len__ if the shards do not pad)."
            )


@functools.lru_cache(maxsize=4)  # the leaves of one gather share their counts: one permutation for all of them
def _order(valid: tuple[int, ...], start: tuple[int, ...], world: int) -> torch.Tensor:
    """Permutation that puts rank-major gathered rows into global sampler order (position * world + rank)."""
    if len(set(start)) == 1:  # the usual case: position by position, rank by rank, skipping ranks that ran out
        offsets = torch.tensor([0, *valid[:-1]], dtype=torch.int64).cumsum(0)
        steps = torch.arange(max(valid, default=0), dtype=torch.int64)
        grid = offsets[None, :] + steps[:, None]  # [position, rank] -> row in the rank-major concatenation
        present = steps[:, None] < torch.tensor(valid, dtype=torch.int64)[None, :]
        return grid[present]
    keys = torch.cat([(torch.arange(v, dtype=torch.int64) + s) * world + r for r, (v, s) in enumerate(zip(valid, start))])
    return torch.argsort(keys, stable=True)


_ALIGN = 16  # bytes; keeps every packed tensor's offset valid for viewing it as its dtype


def _padded_nbytes(numel: int, dtype: torch.dtype) -> int:
    return -(-numel * dtype.itemsize // _ALIGN) * _ALIGN


def _pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The bytes of several tensors in one flat uint8 tensor, each starting at a 16-byte boundary."""
    if not tensors:
        return None
    device = comm_device()
    out = torch.zeros(sum(_padded_nbytes(t.numel(), t.dtype) for t in tensors), dtype=torch.uint8, device=device)
    offset = 0
    for tensor in tensors:
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        out[offset:offset + raw.numel()] = raw.to(device)
        offset += _padded_nbytes(tensor.numel(), tensor.dtype)
    return out


def _unpack(raw: torch.Tensor, layout: Sequence[tuple[torch.dtype, int, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Inverse of :func:`_pack` for one rank: ``layout`` lists (dtype, rows, shape of a row) per tensor."""
    out, offset = [], 0
    for dtype, rows, shape in layout:
        numel = rows * math.prod(shape)
        out.append(raw[offset:offset + numel * dtype.itemsize].view(dtype).reshape(rows, *shape))
        offset += _padded_nbytes(numel, dtype)
    return out


__all__ = [
    "gather_for_metrics", "pad_across_processes", "gather_object", "end_of_dataloader", "GatherState", "GatherError",
    "fail_gather", "track", "current_state", "find_distributed_sampler",
]
