"""A DeepSpeed op build killed half-way leaves torch's ``lock`` in the extension cache; lightspeed clears it (with a
message naming it) instead of letting every later run wait forever, and leaves the lock of a live build alone."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from lightspeed.core.zero.runtime import clear_stale_build_locks


def _lock(root: Path, op: str, age_s: float) -> Path:
    build_dir = root / op
    build_dir.mkdir(parents=True)
    lock = build_dir / "lock"
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_an_old_lock_no_build_holds_is_removed_with_a_message_naming_it(tmp_path: Path) -> None:
    lock = _lock(tmp_path, "async_io", age_s=600)
    messages: list[str] = []
    assert clear_stale_build_locks(tmp_path, report=messages.append) == [lock]
    assert not lock.exists()
    assert messages == [
        f"lightspeed: removed the stale build lock {str(lock)!r}: a build of DeepSpeed op 'async_io' was killed "
        "half-way and no process is building it; it is built again now."
    ]


def test_a_young_lock_no_build_holds_is_waited_for_then_removed(tmp_path: Path) -> None:
    lock = _lock(tmp_path, "cpu_adam", age_s=15)
    messages: list[str] = []
    naps: list[float] = []

    def sleep(seconds: float) -> None:  # time passes: the lock ages past the limit
        naps.append(seconds)
        os.utime(lock, (time.time() - 400, time.time() - 400))

    assert clear_stale_build_locks(tmp_path, report=messages.append, poll_s=0.5, sleep=sleep) == [lock]
    assert naps == [0.5] and not lock.exists()
    assert messages[0] == (
        f"lightspeed: waiting for the build lock {str(lock)!r}: no process is building DeepSpeed op 'cpu_adam'; the "
        "lock is removed once it is 300 s old."
    )
    assert messages[1].startswith(f"lightspeed: removed the stale build lock {str(lock)!r}")


def test_the_lock_of_a_live_build_is_left_to_torch_with_a_message(tmp_path: Path) -> None:
    lock = _lock(tmp_path, "cpu_adam", age_s=600)
    builder = subprocess.Popen(["sleep", "30"], cwd=lock.parent)  # stands for ninja, run in the build directory
    try:
        messages: list[str] = []
        assert clear_stale_build_locks(tmp_path, report=messages.append) == []
        assert lock.exists()
        assert messages == [
            f"lightspeed: waiting for the build of DeepSpeed op 'cpu_adam' by process {builder.pid} "
            f"(lock {str(lock)!r})."
        ]
    finally:
        builder.kill()
        builder.wait()


def test_a_lock_of_a_few_seconds_is_an_op_being_loaded_and_gets_no_message(tmp_path: Path) -> None:
    lock = _lock(tmp_path, "cpu_adam", age_s=1)
    messages: list[str] = []

    def released(seconds: float) -> None:  # the other process finishes loading the op and releases its lock
        lock.unlink()

    assert clear_stale_build_locks(tmp_path, report=messages.append, sleep=released) == []
    assert messages == []


def test_no_lock_no_message(tmp_path: Path) -> None:
    (tmp_path / "cpu_adam").mkdir()
    messages: list[str] = []
    assert clear_stale_build_locks(tmp_path, report=messages.append) == [] and messages == []
