"""Turn a collective that timed out into an error that says which collective and which ranks did not arrive.

A rank that stops answering (a stopped or swapped-out process, a dead node, a rank stuck in native code) leaves the
others waiting inside a collective until the process group's timeout, after which the backend raises an error that
names neither the collective nor the missing ranks. lightspeed keeps one lightweight heartbeat per rank in the
process group's store: a background thread increments a counter every ``interval`` seconds and publishes the
rank's position (e.g. ``step 12``). When a collective times out, the failing rank reads every counter twice,
``2 * interval`` apart: a rank whose counter did not move is not running (no clock comparison across machines);
a live rank at another position is named with it. One store write per rank and interval, nothing per collective.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType
from typing import Any

from lightspeed.core.errors import CollectiveTimeoutError

__all__ = [
    "CollectiveTimeoutError",
    "Heartbeat",
    "collective_name",
    "heartbeat_interval",
    "is_collective_timeout",
    "describe_missing_ranks",
    "timeout_message",
]

_KEY = "lightspeed/heartbeat/"


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

    def _beat(self) -> None:
        self._beats += 1
        where = ""
        if self._position is not None:
            try:
                where = self._position()
            except Exception:  # noqa: BLE001 - the position is a courtesy; never let it kill the heartbeat
                where = ""
        self._store.set(f"{_KEY}{self._rank}", f"{self._beats}|{where}")

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
        f"{' (' + notes + ')' if notes else ''}. Exiting so that an elastic launcher (torchrun --max-restarts) can "
        f"restart the job from the last checkpoint. Backend error: {str(error).strip().splitlines()[0]}"
    )
