"""No silent hangs: a rank that stops answering (SIGSTOP) makes the others fail within the strategy's ``timeout=``
with an error naming the collective and the rank that did not arrive, and a rank that fails and exits makes the others
fail at once naming it, so an elastic launcher can restart the job; under the Trainer and in a Fabric loop."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from _elastic import SCRIPTS, elastic_command

from _support.launch import REPO_ROOT, child_env, run_torchrun

TIMEOUT_S = 20
COLLECTIVE = {
    "zero2": r"`torch\.distributed\.all_reduce`",  # ZeRO-2's gradient reduction, called from Python
    "ddp_exact": r"the gradient all-reduce of `DistributedDataParallel` \(during backward\)",  # DDP's C++ reducer
}


WORKERS = {"trainer": ("hang.py",), "fabric": ("fabric_loop.py", "hang")}


@pytest.mark.parametrize(("strategy", "front_end"), [("zero2", "trainer"), ("ddp_exact", "fabric")])
def test_a_stopped_rank_makes_the_others_fail_with_a_named_collective_and_rank(
    tmp_path: Path, strategy: str, front_end: str
) -> None:
    script, *mode = WORKERS[front_end]
    cmd = elastic_command(script, 2, [*mode, tmp_path, strategy, TIMEOUT_S], max_restarts=0)
    error_file, stopped_file = tmp_path / "rank0_error.txt", tmp_path / "stopped_pid.txt"
    proc = subprocess.Popen(cmd, env=child_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 400  # generous: startup on a loaded machine, then the 8 s timeout
        while not error_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert error_file.exists(), "rank 0 never failed: the stopped rank hung the job"
    finally:
        if stopped_file.exists():  # the stopped worker ignores torchrun's SIGTERM until killed
            os.kill(int(stopped_file.read_text()), signal.SIGKILL)
        output = proc.communicate(timeout=120)[0].decode(errors="replace")
    assert proc.returncode != 0, output[-4000:]
    assert not list(tmp_path.glob("finished*.txt"))
    first_line = error_file.read_text().splitlines()[0]
    assert re.fullmatch(
        rf"CollectiveTimeoutError: Rank 0 waited {TIMEOUT_S}s \(the strategy's `timeout=`\) in "
        rf"{COLLECTIVE[strategy]}: rank 1 did not arrive "
        r"\(rank 1: no heartbeat for [\d.]+s \(stopped, dead or hung in native code\)\)\. Exiting so that an elastic "
        r"launcher \(torchrun --max-restarts\) can restart the job from the last checkpoint\. Backend error: .*"
        rf"Timed out waiting {TIMEOUT_S}000ms.*",
        first_line,
    ), first_line


def test_a_run_whose_heartbeat_never_pauses_still_exits_0() -> None:
    """lightspeed's exit hook stops the heartbeat before Python shuts down: a daemon thread still writing to the
    store then ends the process with 'terminate called without an active exception' (-6) after a successful run."""
    proc = run_torchrun(SCRIPTS / "heartbeat_exit.py", 2, check=False, retry_native_abort=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "terminate called" not in output, output[-3000:]
    assert all(f"rank {rank} done" in proc.stdout for rank in (0, 1)), output[-3000:]


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
def test_a_rank_that_fails_and_exits_is_named_by_the_rank_waiting_for_it(tmp_path: Path, front_end: str) -> None:
    """gloo ends the wait of the rank left behind with 'Connection closed by peer'; lightspeed names the collective
    and the rank that left (:class:`RankLostError`, a :class:`CollectiveTimeoutError`) without waiting for the
    timeout."""
    script, *mode = WORKERS[front_end]
    started = time.monotonic()
    proc = run_torchrun(
        SCRIPTS / script,
        2,
        [*mode, tmp_path, "zero2", 600, "exits"],  # a timeout that never fires within the test's own limit
        check=False,
        timeout=400,
    )
    assert proc.returncode != 0 and not list(tmp_path.glob("finished*.txt")), proc.stdout[-3000:]
    assert "rank 1 fails on purpose" in proc.stdout + proc.stderr
    first_line = (tmp_path / "rank0_error.txt").read_text().splitlines()[0]
    assert re.fullmatch(
        r"RankLostError: Rank 0 was waiting in `torch\.distributed\.\w+` when rank 1 left the job at step 3, so the "
        r"collective can never complete; the rank that left printed its own error first \(a timeout in a collective of "
        r"its own, or the failure that ended it\)\. Exiting so that an elastic launcher \(torchrun --max-restarts\) "
        r"can restart the job from the last checkpoint\. Backend error: .*Connection (closed|reset) by peer.*",
        first_line,
    ), first_line
    assert time.monotonic() - started < 300  # not the 600 s timeout


def _one_rank_collective_error(rank: int, text: str) -> str:
    """Which named error ``text`` is: the rank timed out in its own collective, or the other rank left first."""
    waited = re.match(
        rf"CollectiveTimeoutError: Rank {rank} waited {TIMEOUT_S}s \(the strategy's `timeout=`\) in "
        r"`torch\.distributed\.\w+`: ",
        text,
    )
    if waited:
        return "timeout"
    assert re.match(
        rf"RankLostError: Rank {rank} was waiting in `torch\.distributed\.\w+` when rank {1 - rank} left the job", text
    ), text
    return "left"


def test_a_collective_of_ones_own_on_one_rank_in_predict_step_under_zero3_is_a_named_error_on_both_ranks(
    tmp_path: Path,
) -> None:
    """Generation and evaluation under ZeRO-3 keep the ranks in step, but a user's own collective on one rank only
    still cannot complete: each rank fails naming the collective it waited in, never a silent hang. Both ranks wait
    with the same timeout, so either may time out first; the other then fails at once naming it as gone."""
    proc = run_torchrun(
        SCRIPTS / "hang.py",
        2,
        [tmp_path, "predict_zero3", TIMEOUT_S],
        check=False,
        timeout=400,
    )
    assert proc.returncode != 0 and not list(tmp_path.glob("finished*.txt"))
    errors = {rank: (tmp_path / f"rank{rank}_error.txt").read_text() for rank in (0, 1)}
    kinds = {rank: _one_rank_collective_error(rank, text) for rank, text in errors.items()}
    assert "timeout" in kinds.values(), errors
    # rank 0 waits in its own all_reduce (whichever rank fails first), rank 1 in the forward pass's collective
    assert "in `torch.distributed.all_reduce`" in errors[0].splitlines()[0], errors[0]
