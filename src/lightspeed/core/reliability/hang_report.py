"""Turn a collective that timed out into an error that says which collective and which ranks did not arrive.

A rank that stops answering (a stopped or swapped-out process, a dead node, a rank stuck in native code) leaves the
others waiting inside a collective until the process group's timeout, after which the backend raises an error that
names neither the collective nor the missing ranks. lightspeed keeps one lightweight heartbeat per rank in the
process group's store: a background thread increments a counter every ``interval`` seconds and publishes the
rank's position (e.g. ``step 12``). When a collective times out, the failing rank reads every counter twice,
``2 * interval`` apart: a rank whose counter did not move is not running (no clock comparison across machines);
a live rank at another position is named with it. One store write per rank and interval, nothing per collective.

A rank can also leave first: its own collective timed out, or it failed, and its process ended while this rank still
waited. gloo then ends this rank's wait at once with "Connection closed by peer" (or "reset by peer"), which names
neither. A stopping heartbeat's last write marks its rank as gone, with its position, before the process closes its
connections, so the rank left behind reads at once who left (:func:`ranks_that_left`), without the two-read wait:
torchrun stops the remaining workers (SIGTERM) right after one fails. A rank killed outright (SIGKILL, the
out-of-memory killer) marks nothing: when no mark comes within two intervals, the ranks whose counter stood still
meanwhile are named (:func:`silent_ranks`). :func:`is_peer_lost` tells that error apart and :func:`peer_lost_message`
names the collective and the rank that left.

The store lives on node 0's host. On a host whose connection to it is cut (its link down, the other host gone without
closing its sockets), a store operation blocks in the kernel until TCP gives up, many minutes later: torch's
``TCPStore`` bounds its waits, not its reads. Every read here therefore runs with a deadline
(:func:`within_deadline`); past it :class:`StoreUnreachable` says the store did not answer, and the report names the
other hosts' ranks instead of hanging.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType
from typing import Any, TypeVar

__all__ = [
    "Heartbeat",
    "StoreUnreachable",
    "collective_name",
    "heartbeat_interval",
    "describe_missing_ranks",
    "is_collective_timeout",
    "is_peer_lost",
    "heartbeats",
    "peer_lost_message",
    "ranks_that_left",
    "silent_ranks",
    "timeout_message",
    "unreachable_store_note",
    "within_deadline",
]

_T = TypeVar("_T")
_KEY = "lightspeed/heartbeat/"
#: written once by a stopping heartbeat: this rank's process is ending (the value is its last position)
_LEFT_KEY = "lightspeed/left/"


def heartbeat_interval(timeout: timedelta) -> float:
    """Seconds between heartbeats: a tenth of the timeout, between 0.5 s and 10 s."""
    return min(10.0, max(0.5, timeout.total_seconds() / 10))


class Heartbeat:
    """Background thread that bumps this rank's counter in ``store`` every ``interval`` seconds.

    ``store`` must be usable from a second thread (give it a client of its own). ``position`` returns a short text
    describing where this rank is (read from the thread; it must not block).
    """

    def __init__(self, store: Any, rank: int, interval: float, position: Callable[[], str] | None = None) -> None:
        self._store, self._rank, self.interval = store, rank, interval
        self._position = position
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lightspeed-heartbeat-{rank}", daemon=True)
        self._beats = 0

    def start(self) -> Heartbeat:
        self._store.delete_key(f"{_LEFT_KEY}{self._rank}")  # a process group created again in the same attempt
        self._beat()
        self._thread.start()
        return self

    def stop(self, wait: float = 30.0) -> None:
        """Stop beating and wait (at most ``wait`` seconds) for the thread to leave the store call it may be in.

        Must run before interpreter shutdown (e.g. from an ``atexit`` hook): a daemon thread still inside a native
        store call when Python finalizes aborts the whole process (``terminate called without an active
        exception``, exit code -6) when the call returns, after an otherwise successful run.
        """
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(wait)
        if self._thread.is_alive():
            return  # still inside a store call: no second one from this thread
        try:
            self._store.set(f"{_LEFT_KEY}{self._rank}", self._where())  # before the process closes its connections
        except Exception:  # noqa: BLE001 - the store went first (its host left): the others fall back to "a rank"
            pass

    def _where(self) -> str:
        if self._position is None:
            return ""
        try:
            return self._position()
        except Exception:  # noqa: BLE001 - the position is a courtesy; never let it kill the heartbeat
            return ""

    def _beat(self) -> None:
        self._beats += 1
        self._store.set(f"{_KEY}{self._rank}", f"{self._beats}|{self._where()}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - store gone (shutdown): stop quietly
                return


class StoreUnreachable(Exception):
    """The job's store did not answer within the deadline: this host lost its connection to node 0's host."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the job's store did not answer for {seconds:g}s")
        self.seconds = seconds


def within_deadline(call: Callable[[], _T], seconds: float) -> _T:
    """``call()`` (store operations) run in a daemon thread and given ``seconds``; :class:`StoreUnreachable` when it
    has not returned by then (the thread is left to the kernel's TCP timeout; the caller is on its way to an error
    exit)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as error:  # noqa: BLE001 - re-raised in the calling thread
            box["error"] = error

    thread = threading.Thread(target=run, name="lightspeed-store-read", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise StoreUnreachable(seconds)
    if "error" in box:
        raise box["error"]
    return box["value"]


def unreachable_store_note(address: str, seconds: float, others: list[int]) -> str:
    """The description of the other ranks when the store did not answer (``others``: the ranks on other hosts, empty
    when unknown)."""
    who = f"ranks {', '.join(map(str, others))} on the other host(s)" if others else "the other hosts' ranks"
    return (
        f"the job's store at {address or 'node 0'} (node 0's host) did not answer for {seconds:g}s: this host lost its "
        f"connection to {who} (a network fault, or their host went away)"
    )


def _read(store: Any, world_size: int) -> dict[int, tuple[int, str] | None]:
    found: dict[int, tuple[int, str] | None] = {}
    for rank in range(world_size):
        key = f"{_KEY}{rank}"
        try:
            if not store.check([key]):
                found[rank] = None
                continue
            count, _, where = store.get(key).decode().partition("|")
            found[rank] = (int(count), where)
        except Exception:  # noqa: BLE001 - an unreadable store reads as "no heartbeat"
            found[rank] = None
    return found


def _left_marks(store: Any, world_size: int, rank: int) -> dict[int, str]:
    left: dict[int, str] = {}
    for other in range(world_size):
        key = f"{_LEFT_KEY}{other}"
        try:
            if other != rank and store.check([key]):
                left[other] = store.get(key).decode()
        except Exception:  # noqa: BLE001 - a store that failed (its host left) names nobody more
            return left
    return left


def ranks_that_left(
    store: Any,
    world_size: int,
    rank: int,
    wait: float = 0.0,
    sleep: Callable[[float], None] = time.sleep,
    read_deadline: float = 20.0,
) -> dict[int, str]:
    """The other ranks whose heartbeat stopped because their process was ending, with the position each had; polls
    for up to ``wait`` seconds until one is marked (a rank whose own timeout closed the connection marks itself a
    moment later, while it reports its own error). :class:`StoreUnreachable` when a pass over the store takes longer
    than ``read_deadline`` seconds."""
    deadline = time.monotonic() + wait
    while True:
        left = within_deadline(lambda: _left_marks(store, world_size, rank), read_deadline)
        if left or time.monotonic() >= deadline:
            return left
        sleep(0.1)


def heartbeats(store: Any, world_size: int, read_deadline: float = 20.0) -> dict[int, tuple[int, str] | None]:
    """Every rank's heartbeat count and position now (None: none yet); :class:`StoreUnreachable` past
    ``read_deadline`` seconds."""
    return within_deadline(lambda: _read(store, world_size), read_deadline)


def silent_ranks(
    store: Any, world_size: int, rank: int, before: dict[int, tuple[int, str] | None], read_deadline: float = 20.0
) -> dict[int, str]:
    """The other ranks whose heartbeat has not moved since ``before`` (:func:`heartbeats`, read at least two
    intervals earlier), with the last position each published: their process ended without marking its exit (killed,
    or its machine went away)."""
    after = heartbeats(store, world_size, read_deadline)
    return {
        other: beat[1]
        for other, beat in after.items()
        if other != rank and beat is not None and before.get(other) == beat
    }


def describe_missing_ranks(
    store: Any,
    world_size: int,
    rank: int,
    interval: float,
    own_position: str = "",
    sleep: Callable[[float], None] = time.sleep,
    read_deadline: float = 20.0,
) -> tuple[list[int], str]:
    """Return (ranks that are not running, one-line description of every other rank's state);
    :class:`StoreUnreachable` when a read of the heartbeats takes longer than ``read_deadline`` seconds."""
    first = heartbeats(store, world_size, read_deadline)
    sleep(2 * interval + 0.1)
    second = heartbeats(store, world_size, read_deadline)
    stopped: list[int] = []
    notes: list[str] = []
    for other in range(world_size):
        if other == rank:
            continue
        before, after = first[other], second[other]
        if after is None:
            stopped.append(other)
            notes.append(f"rank {other}: never sent a heartbeat")
        elif before is not None and before[0] == after[0]:
            stopped.append(other)
            notes.append(f"rank {other}: no heartbeat for {2 * interval:.1f}s (stopped, dead or hung in native code)")
        elif after[1] and own_position and after[1] != own_position:
            notes.append(f"rank {other}: alive at {after[1]}")
    return stopped, "; ".join(notes)


_TIMEOUT_WORDS = ("timed out", "timeout", "time out")


def is_collective_timeout(error: BaseException) -> bool:
    """True for the errors gloo/NCCL raise when a collective exceeds the process group's timeout."""
    text = str(error).lower()
    return (
        isinstance(error, RuntimeError)
        and any(word in text for word in _TIMEOUT_WORDS)
        and (
            collective_name(error.__traceback__) is not None or "gloo" in text or "nccl" in text or "collective" in text
        )
    )


#: what gloo's (and NCCL's socket transport's) errors say when the rank at the other end of a connection has gone;
#: "application timeout caused pair closure" is the other rank's own collective timing out
_PEER_LOST_WORDS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "application timeout caused pair closure",
)


def is_peer_lost(error: BaseException) -> bool:
    """True when a collective failed because another rank's process closed its connections (it left the job)."""
    text = str(error).lower()
    return (
        isinstance(error, RuntimeError)
        and any(words in text for words in _PEER_LOST_WORDS)
        and (collective_name(error.__traceback__) is not None or "gloo" in text or "nccl" in text)
    )


def collective_name(tb: TracebackType | None) -> str | None:
    """Which collective the traceback waited in: the innermost ``torch.distributed`` (or ``deepspeed.comm``)
    function, e.g. ``torch.distributed.all_reduce``; a wait inside autograd's backward with no such function is
    ``DistributedDataParallel``'s gradient all-reduce (its reducer runs in C++)."""
    name: str | None = None
    in_backward = False
    for frame, _ in traceback.walk_tb(tb):
        module = frame.f_globals.get("__name__", "")
        function = frame.f_code.co_name
        if module == "torch.distributed.distributed_c10d" or module.startswith("deepspeed.comm"):
            if not function.startswith("_") and function not in ("wrapper", "log_wrapper"):
                prefix = "torch.distributed" if module.startswith("torch") else "deepspeed.comm"
                name = f"`{prefix}.{function}`"
        elif module.startswith("torch.autograd") and function in ("_engine_run_backward", "backward"):
            in_backward = True
    if name is None and in_backward:
        return "the gradient all-reduce of `DistributedDataParallel` (during backward)"
    return name


def _backend_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0]


_RESTART_HINT = (
    "Exiting so that an elastic launcher (torchrun --max-restarts) can restart the job from the last checkpoint."
)


def peer_lost_message(
    rank: int,
    left: dict[int, str],
    collective: str | None,
    error: BaseException,
    silent: dict[int, str] | None = None,
) -> str:
    """The message of :class:`~lightspeed.errors.RankLostError`; ``left`` is :func:`ranks_that_left`, ``silent``
    (read when no rank marked its exit) :func:`silent_ranks`."""
    what = collective or "a collective"
    why = (
        "the rank that left printed its own error first (a timeout in a collective of its own, or the failure that "
        "ended it)"
    )
    if left:
        who = _ranks_at(left, "left the job")
    elif silent:
        who = _ranks_at(silent, "ended without a word")
        why = (
            "its heartbeat stopped and it recorded no exit: it was killed (SIGKILL, the out-of-memory killer) or its "
            "machine went away"
        )
    else:
        who = "another rank closed its connection without saying so (killed, or its machine went away)"
    return (
        f"Rank {rank} was waiting in {what} when {who}, so the collective can never complete; {why}. "
        f"{_RESTART_HINT} Backend error: {_backend_line(error)}"
    )


def _ranks_at(positions: dict[int, str], what: str) -> str:
    """``rank 1 <what> at step 3`` or ``ranks 1, 3 <what> (rank 1 at step 3; rank 3 at step 2)``."""
    if len(positions) == 1:
        ((other, position),) = positions.items()
        return f"rank {other} {what}{' at ' + position if position else ''}"
    where = "; ".join(f"rank {other} at {position}" for other, position in positions.items() if position)
    return f"ranks {', '.join(map(str, positions))} {what}{' (' + where + ')' if where else ''}"


def timeout_message(
    error: BaseException,
    timeout: timedelta,
    timeout_source: str,
    rank: int,
    stopped: list[int],
    notes: str,
    collective: str | None,
) -> str:
    """The message of :class:`CollectiveTimeoutError` (``timeout_source``: where the timeout was set)."""
    what = collective or "a collective"
    if stopped:
        missing = f"rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} did not arrive"
    else:
        missing = "every other rank is still running, so some rank is waiting elsewhere (not in this collective)"
    return (
        f"Rank {rank} waited {timeout.total_seconds():g}s ({timeout_source}) in {what}: {missing}"
        f"{' (' + notes + ')' if notes else ''}. {_RESTART_HINT} Backend error: {_backend_line(error)}"
    )
