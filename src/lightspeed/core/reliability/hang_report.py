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
torchrun stops the remaining workers (SIGTERM) right after one fails. :func:`is_peer_lost` tells that error apart and
:func:`peer_lost_message` names the collective and the rank that left.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType
from typing import Any

__all__ = [
    "Heartbeat",
    "collective_name",
    "heartbeat_interval",
    "describe_missing_ranks",
    "is_collective_timeout",
    "is_peer_lost",
    "peer_lost_message",
    "ranks_that_left",
    "timeout_message",
]

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


def ranks_that_left(
    store: Any, world_size: int, rank: int, wait: float = 0.0, sleep: Callable[[float], None] = time.sleep
) -> dict[int, str]:
    """The other ranks whose heartbeat stopped because their process was ending, with the position each had; polls
    for up to ``wait`` seconds until one is marked (a rank whose own timeout closed the connection marks itself a
    moment later, while it reports its own error)."""
    deadline = time.monotonic() + wait
    while True:
        left: dict[int, str] = {}
        for other in range(world_size):
            key = f"{_LEFT_KEY}{other}"
            try:
                if other != rank and store.check([key]):
                    left[other] = store.get(key).decode()
            except Exception:  # noqa: BLE001 - an unreachable store (its host left) names nobody
                return left
        if left or time.monotonic() >= deadline:
            return left
        sleep(0.1)


def describe_missing_ranks(
    store: Any,
    world_size: int,
    rank: int,
    interval: float,
    own_position: str = "",
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[list[int], str]:
    """Return (ranks that are not running, one-line description of every other rank's state)."""
    first = _read(store, world_size)
    sleep(2 * interval + 0.1)
    second = _read(store, world_size)
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


def peer_lost_message(rank: int, left: dict[int, str], collective: str | None, error: BaseException) -> str:
    """The message of :class:`~lightspeed.errors.RankLostError`; ``left`` is :func:`ranks_that_left`."""
    what = collective or "a collective"
    if len(left) == 1:
        ((other, position),) = left.items()
        who = f"rank {other} left the job{' at ' + position if position else ''}"
    elif left:
        where = "; ".join(f"rank {other} at {position}" for other, position in left.items() if position)
        who = f"ranks {', '.join(map(str, left))} left the job{' (' + where + ')' if where else ''}"
    else:
        who = "another rank closed its connection without saying so (killed, or its machine went away)"
    return (
        f"Rank {rank} was waiting in {what} when {who}, so the collective can never complete; the rank that left "
        f"printed its own error first (a timeout in a collective of its own, or the failure that ended it). "
        f"{_RESTART_HINT} Backend error: {_backend_line(error)}"
    )


def timeout_message(
    error: BaseException, timeout: timedelta, rank: int, stopped: list[int], notes: str, collective: str | None
) -> str:
    """The message of :class:`CollectiveTimeoutError`."""
    what = collective or "a collective"
    if stopped:
        missing = f"rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} did not arrive"
    else:
        missing = "every other rank is still running, so some rank is waiting elsewhere (not in this collective)"
    return (
        f"Rank {rank} waited {timeout.total_seconds():g}s (the strategy's `timeout=`) in {what}: {missing}"
        f"{' (' + notes + ')' if notes else ''}. {_RESTART_HINT} Backend error: {_backend_line(error)}"
    )
