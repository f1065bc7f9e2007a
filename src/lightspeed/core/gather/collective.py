"""One collective per gather that also checks the ranks agree, so that a mistake raises a clear error on every
rank instead of hanging or returning garbage.

Each gather is a single all-gather of one buffer per rank holding

* a header: a checksum of the data's structure and dtypes, which call this is (per-batch gather, end of a
  dataloader, ...), an error flag, and a few integers (row counts, shapes) whose number follows from the structure;
* the data itself, packed as bytes, when it fits the buffer size the ranks agreed on (every rank derives it from
  the previous gathers, so the sizes always match); otherwise a second all-gather carries it.

Every call sends the same number of bytes, data or not (``pad_across_processes`` and the end-of-dataloader check
carry zeros where a gather's data would go): ranks that are in *different* calls (one still gathering a batch while
another has reached the end of its shorter shard) must still meet in a collective of one size, since gloo aborts
the process on a size mismatch; only equal sizes let them compare headers and raise a clear error.

Only when the headers disagree do the ranks exchange full descriptions (one object gather) to say which rank
differs and how. A rank that never arrives is named, on every rank that did, after ``LIGHTSPEED_GATHER_TIMEOUT``
seconds (default 300; ``0`` waits forever): the collective is waited on with that timeout (gloo), then each
waiting rank marks itself present in the process group's store and looks for the others for up to the same time.
Under NCCL, whose waits cannot time out this way, the process group's own timeout applies.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Sequence
from datetime import timedelta
from enum import IntEnum
from typing import NoReturn

import torch
import torch.distributed as dist

from lightspeed.core.common.distributed import is_distributed
from lightspeed.core.errors import CallSiteMismatchError, GatherError
from lightspeed.core.gather.accounting import GatherState, current_state

TIMEOUT_ENV = "LIGHTSPEED_GATHER_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0


class CallSite(IntEnum):
    """Which collective a rank is in; travels in every header, so ranks in different calls are told apart."""

    GATHER = 1  # gather_for_metrics
    END = 2  # end_of_dataloader
    OBJECT = 3  # gather_object
    PAD = 4  # pad_across_processes


def gather_timeout() -> float:
    """Seconds a gather waits for every rank (``LIGHTSPEED_GATHER_TIMEOUT``; 0 waits without a limit)."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"{TIMEOUT_ENV}={raw!r} is not a number of seconds; set it to e.g. 300 (or 0 to wait without a limit)."
        ) from None
    if value < 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be >= 0 seconds (0 waits without a limit).")
    return value


def comm_device() -> torch.device:
    """Device for small control tensors: CUDA under NCCL, else CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_SEQUENCE = 0  # gathers made by this process; equal on all ranks while they make the same calls


def _wait(work: dist.Work, what: str, timeout: float) -> None:
    """Wait for a collective; if it does not finish in time, name the ranks that never arrived."""
    if timeout == 0 or dist.get_backend() != "gloo":
        work.wait()
        return
    try:
        work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as err:
        raise GatherError(_missing_ranks_message(what, timeout)) from err


def _missing_ranks_message(what: str, timeout: float) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    hint = (
        "every rank must call it the same number of times (e.g. all ranks run the same number of evaluation "
        f"batches); raise {TIMEOUT_ENV} (now {timeout:g} s) if a rank is merely slow."
    )
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store to ask: say what we know
        return f"{what}: not every rank arrived within {timeout:g} s; {hint}"
    keys = [f"lightspeed_gather/{_SEQUENCE}/{r}" for r in range(world)]
    store.set(keys[rank], "arrived")
    # ranks that arrived later than this one time out later; give them the same time to mark themselves
    deadline = time.monotonic() + timeout
    present = [rank]
    while True:
        present = [r for r in range(world) if store.check([keys[r]])]
        if len(present) == world or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    missing = [r for r in range(world) if r not in present]
    if not missing:
        return f"{what}: every rank arrived but the collective failed (a rank may be in a different collective); {hint}"
    return f"{what}: rank(s) {', '.join(map(str, missing))} did not arrive within {timeout:g} s; {hint}"


def all_gather_flat(output: torch.Tensor, local: torch.Tensor, async_op: bool = False) -> dist.Work | None:
    """Same-size all-gather into one tensor (``all_gather_single`` where it exists, its older name elsewhere)."""
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather_single(output, local, async_op=async_op)


def checksum(text: str) -> int:
    """A stable 31-bit checksum of ``text`` (identical in every process, unlike ``hash``)."""
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


#: ints of payload that travel in the header; longer payloads take one more all-gather
PAYLOAD_CAPACITY = 58
_HEADER_INTS = 6 + PAYLOAD_CAPACITY
_HEADER_BYTES = 8 * _HEADER_INTS  # a multiple of 16, so packed data after it stays aligned
#: data up to this many bytes rides in the header's collective once the ranks have seen gathers that large
INLINE_DATA_LIMIT = 256 * 1024
_inline_capacity = 0  # bytes of data every next collective carries (any call site); same on every rank


def agree(
    what: str,
    signature: Sequence[str],
    call_site: tuple[int, int],
    call_site_text: str,
    error: str | None = None,
    payload: Sequence[int] = (),
    data: torch.Tensor | None = None,
    error_type: type[GatherError] = GatherError,
) -> tuple[list[list[int]], list[torch.Tensor] | None]:
    """Check that every rank is in the same call with the same data layout, and exchange ``payload`` and ``data``.

    ``signature`` is one line per leaf ("path: description"), ``call_site`` two integers identifying the call
    (a :class:`CallSite`, batch number) with ``call_site_text`` its human form, ``error`` a problem this rank found
    locally: any disagreement raises a :class:`GatherError` on every rank; a rank's ``error`` is raised everywhere as
    that rank's ``error_type`` (a subclass, so one ``except GatherError`` catches all). ``payload`` (ints whose
    count follows from the signature) and ``data`` (a flat uint8 tensor whose length is a multiple of 16) come
    back per rank.
    """
    global _SEQUENCE, _inline_capacity
    _SEQUENCE += 1
    world = dist.get_world_size()
    device = comm_device()
    data_len = 0 if data is None else int(data.numel())
    capacity = _inline_capacity
    inline_payload = len(payload) <= PAYLOAD_CAPACITY
    inline_data = data_len <= capacity
    header = [
        checksum("\n".join(signature)),
        call_site[0],
        call_site[1],
        int(error is not None),
        data_len,
        int(inline_data),
    ]
    header += list(payload) + [0] * (PAYLOAD_CAPACITY - len(payload)) if inline_payload else [0] * PAYLOAD_CAPACITY
    local = torch.zeros(_HEADER_BYTES + capacity, dtype=torch.uint8, device=device)
    local[:_HEADER_BYTES] = torch.tensor(header, dtype=torch.int64).view(torch.uint8).to(device)
    if data is not None and inline_data and data_len:
        local[_HEADER_BYTES : _HEADER_BYTES + data_len] = data.to(device)
    gathered = torch.empty(world * local.numel(), dtype=torch.uint8, device=device)
    work = all_gather_flat(gathered, local, async_op=True)
    assert work is not None  # async_op=True always returns the work to wait on
    _wait(work, what, gather_timeout())
    gathered = gathered.view(world, -1)
    rows = gathered[:, :_HEADER_BYTES].cpu().contiguous().view(torch.int64).view(world, _HEADER_INTS).tolist()
    if not all(row[:3] == rows[0][:3] and row[3] == 0 for row in rows):
        details: list = [None] * world
        dist.all_gather_object(details, (list(signature), call_site_text, error, error_type))
        errors = [kind for _, _, err, kind in details if err]
        different_sites = len({site for _, site, _, _ in details}) > 1
        raising = errors[0] if errors else (CallSiteMismatchError if different_sites else GatherError)
        raise raising(describe_disagreement(what, [d[:3] for d in details]))
    payloads = [row[6 : 6 + len(payload)] for row in rows] if inline_payload else all_gather_ints(payload)
    if data is None:
        return payloads, None
    lengths = [row[4] for row in rows]
    longest = max(lengths)
    if longest <= INLINE_DATA_LIMIT:  # every rank takes the same decision from the same headers
        _inline_capacity = max(_inline_capacity, longest)
    if all(row[5] for row in rows):
        return payloads, [gathered[r, _HEADER_BYTES : _HEADER_BYTES + lengths[r]] for r in range(world)]
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data_len] = data.to(device)
    second = torch.empty(world * longest, dtype=torch.uint8, device=device)
    if longest:
        all_gather_flat(second, padded)
    second = second.view(world, longest)
    return payloads, [second[r, : lengths[r]] for r in range(world)]


def describe_disagreement(what: str, details: Sequence[tuple[list[str], str, str | None]]) -> str:
    """Human explanation of how ranks differ (errors first, then call site, then structure)."""
    by_error: dict[str, list[int]] = {}
    for rank, (_, _, err) in enumerate(details):
        if err:
            by_error.setdefault(err, []).append(rank)
    if by_error:  # the same problem on several ranks is said once
        return f"{what}: " + "; ".join(
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {err}"
            for err, ranks in by_error.items()
        )
    sites = [site for _, site, _ in details]
    if len(set(sites)) > 1:
        listing = "; ".join(f"rank {r} is in {site}" for r, site in enumerate(sites))
        return (
            f"{what}: the ranks are not in the same call ({listing}). Every rank must run the same number of "
            "evaluation batches and make the same gathers; an IterableDataset must yield the same number of batches "
            "on every rank (pad the shards and give the dataset a __len__ with the true total). Shards without "
            "padding may differ in batches if every rank gathers once after its loop (GatherForMetrics does that "
            "itself)."
        )

    def split(signature: list[str]) -> tuple[list[str], list[str]]:
        return [x for x in signature if not x.startswith("accounting:")], [
            x for x in signature if x.startswith("accounting:")
        ]

    reference, reference_accounting = split(details[0][0])
    for rank, (signature, _, _) in enumerate(details[1:], start=1):
        leaves, accounting = split(signature)
        if leaves != reference:
            return (
                f"{what}: rank {rank} passed different data than rank 0 "
                f"({_first_difference(reference, leaves, rank)}). "
                "Every rank must pass the same structure (same keys, same nesting) with the same dtypes and number "
                "of dimensions."
            )
        if accounting != reference_accounting:
            return (
                f"{what}: rank {rank} counts its evaluation samples differently than rank 0 "
                f"({_first_difference(reference_accounting, accounting, rank)}). Every rank must evaluate the same "
                "dataloader; an IterableDataset's len() must be the total number of samples over all ranks, the "
                "same value on every rank."
            )
    return f"{what}: the ranks disagree but their descriptions match; please report this."


def _first_difference(reference: list[str], other: list[str], rank: int) -> str:
    for line_ref, line_other in zip(reference, other, strict=False):
        if line_ref != line_other:
            return f"rank 0 has {line_ref!r}, rank {rank} has {line_other!r}"
    extra = (reference[len(other) :] or other[len(reference) :] or ["?"])[0]
    return f"rank 0 has {len(reference)} leaves, rank {rank} has {len(other)}; unmatched: {extra!r}"


def all_gather_ints(values: Sequence[int]) -> list[list[int]]:
    """All-gather a list of ints that has the same length on every rank (checked by :func:`agree` first)."""
    world = dist.get_world_size()
    if not values:
        return [[] for _ in range(world)]
    mine = torch.tensor(list(values), dtype=torch.int64, device=comm_device())
    gathered = torch.empty(world * mine.numel(), dtype=torch.int64, device=mine.device)
    all_gather_flat(gathered, mine)
    return gathered.view(world, -1).tolist()


def gather_site(state: GatherState | None) -> tuple[int, int]:
    """The call site of a ``gather_for_metrics`` call: which batch of its dataloader it gathers (0 without a state, and
    for shards whose ranks may run different numbers of batches, see :attr:`GatherState.batches_may_differ`)."""
    return (CallSite.GATHER, state.batches if state is not None and not state.batches_may_differ else 0)


def fail_gather(error: GatherError, state: GatherState | None = None) -> NoReturn:
    """Raise ``error`` on every rank, from inside the ``gather_for_metrics`` call that the other ranks are in.

    For a rank that cannot make its gather (e.g. a step returned no predictions): raising only here would leave
    the other ranks waiting in theirs. Instead this rank joins that collective flagged as failed, and every rank
    raises ``type(error)`` with the message, naming this rank. Without a process group it raises ``error`` as is.
    """
    if not is_distributed():
        raise error
    state = state if state is not None else current_state()
    site = gather_site(state)
    agree("gather_for_metrics", ["failed"], site, "a failed gather_for_metrics", str(error), error_type=type(error))
    raise error  # not reached: agree raises on every rank when one reports an error


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "INLINE_DATA_LIMIT",
    "PAYLOAD_CAPACITY",
    "TIMEOUT_ENV",
    "CallSite",
    "agree",
    "all_gather_flat",
    "all_gather_ints",
    "checksum",
    "comm_device",
    "describe_disagreement",
    "fail_gather",
    "gather_site",
    "gather_timeout",
]
