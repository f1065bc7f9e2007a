"""SIGTERM under :func:`lightspeed.core.reliability.termination.name_failures_before_termination`: the default
action when no error is handled; an error being handled is finished first (then the process ends, at the latest after
the grace period); a handler of the user's stays. Each case is its own process (signals)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from _support.launch import REPO_ROOT, child_env

CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from lightspeed.core.reliability import termination

    case = sys.argv[1]
    termination.GRACE_S = 1.0
    if case == "user_handler":
        signal.signal(signal.SIGTERM, lambda *_: print("user handler", flush=True))
    termination.name_failures_before_termination()
    if case in ("idle", "user_handler"):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        print("still running", flush=True)
        sys.exit(0)
    try:
        raise RuntimeError("a collective failed")
    except RuntimeError:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)
        print("failure named", flush=True)
        if case == "stuck_handling":
            time.sleep(30)
    time.sleep(10)
    print("still running", flush=True)
    """
)


def _run(case: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, case], env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    return proc, time.monotonic() - started


def test_sigterm_with_no_error_being_handled_ends_the_process_by_the_signal() -> None:
    proc, _ = _run("idle")
    assert proc.returncode == -15 and "still running" not in proc.stdout, proc.stdout + proc.stderr


def test_sigterm_while_an_error_is_handled_lets_it_finish_then_ends_the_process() -> None:
    proc, seconds = _run("handling")
    assert proc.returncode == -15, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["failure named"], proc.stdout + proc.stderr
    assert "SIGTERM received while an error is handled" in proc.stderr
    assert seconds < 9  # not the 10 s sleep after the error


def test_a_rank_stuck_handling_an_error_exits_143_after_the_grace_period() -> None:
    proc, seconds = _run("stuck_handling")
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["failure named"]
    assert seconds < 25  # GRACE_S = 1, not the 30 s sleep


def test_a_sigterm_handler_of_the_users_is_left_in_place() -> None:
    proc, _ = _run("user_handler")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["user handler", "still running"]
