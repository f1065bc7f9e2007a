"""Running torchrun for ``lightspeed test`` so that a hung run is killed whole: its own process group, a timeout,
SIGTERM then SIGKILL for every process in the group (no orphaned workers holding the port, GPUs or memory)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now (for the rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_process_group(
    command: list[str], env: dict[str, str], timeout: float, grace: float = 10.0
) -> subprocess.CompletedProcess:
    """Run ``command`` in a new process group and capture its output; past ``timeout`` seconds (or on Ctrl-C) the
    whole group gets SIGTERM, then SIGKILL after ``grace`` seconds, so torchrun's workers die with it.

    ``subprocess.run(timeout=...)`` would kill only torchrun and leave its workers running (holding the port, the
    GPUs and memory). A timeout returns exit code 124 with the reason appended to stderr.
    """
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        _signal_group(proc.pid, signal.SIGKILL)  # whatever outlived the leader (a worker ignoring SIGTERM)
        return subprocess.CompletedProcess(command, 124, out, (err or "") + f"\nTimed out after {timeout:.0f} s")
    except BaseException:  # Ctrl-C (KeyboardInterrupt) or any other error: never leave the workers behind
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # the group is gone already
