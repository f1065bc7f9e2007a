"""Let a rank finish naming the failure it is handling before a launcher's SIGTERM ends it.

When one worker fails, torchrun stops the others with SIGTERM within its monitor interval (0.1 s). A rank whose
collective that failure just broke (gloo's "Connection closed by peer") needs a few milliseconds more to turn it into
a :class:`~lightspeed.errors.RankLostError` naming the rank that left; under the default SIGTERM action it was
sometimes killed first and its log said nothing. The Trainer never had that race (Lightning's own SIGTERM handler
only records the signal); a Fabric loop has no handler, so lightspeed installs this one there:

* SIGTERM while no exception is being handled: the default action at once (the process ends by the signal, exactly as
  without the handler);
* SIGTERM while the main thread handles an exception (a collective's error on its way to being named): the
  exception goes on; a watcher thread sends SIGTERM again once the main thread handles no exception any more, and
  ends the process with exit code 143 after :data:`GRACE_S` seconds in any case (torchrun's SIGKILL follows after
  30 s).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

__all__ = ["GRACE_S", "name_failures_before_termination"]

log = logging.getLogger(__name__)

GRACE_S = 20.0
"""At most this long after SIGTERM a rank handling an error keeps running."""

_POLL_S = 0.05
_deferred_at: float | None = None


def name_failures_before_termination() -> None:
    """Install the SIGTERM handler described above in the main thread, where SIGTERM still has its default action
    (a handler of the user's, or Lightning's, is left alone); idempotent."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _deferred_at
    if sys.exc_info()[1] is None:
        _terminate_by_signal()
    if _deferred_at is None:
        _deferred_at = time.monotonic()
        log.warning("SIGTERM received while an error is handled: the process ends once it has been reported")
        threading.Thread(target=_end_after_the_error, name="lightspeed-sigterm", daemon=True).start()


def _terminate_by_signal() -> None:
    """The default action of SIGTERM, from the main thread."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _end_after_the_error() -> None:
    """Watcher: SIGTERM again whenever the main thread handles no exception (its handler then ends the process), and
    exit 143 after :data:`GRACE_S` (the main thread may be stuck in native code, where no Python handler runs)."""
    assert _deferred_at is not None
    main = threading.main_thread().ident
    while time.monotonic() - _deferred_at < GRACE_S:
        if _handled_exception(main) is None:
            os.kill(os.getpid(), signal.SIGTERM)  # deferred again if a new exception came first
        time.sleep(_POLL_S)
    os._exit(128 + signal.SIGTERM)


def _handled_exception(thread_id: int | None) -> BaseException | None:
    """The exception ``thread_id`` is handling now, if any."""
    current: Any = sys._current_exceptions().get(thread_id or 0)
    if isinstance(current, tuple):  # Python < 3.12: an exc_info triple
        current = current[1]
    return current if isinstance(current, BaseException) else None
