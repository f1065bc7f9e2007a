"""``lightspeed test``: a real 2-process run that passes, a real run that breaks (exit 1 with the cause), the rank
comparison on synthetic results, and the known-cause fixes."""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import pytest

from lightspeed.cli.main import main
from lightspeed.cli.selftest.checks import compare_ranks, diagnose
from lightspeed.cli.selftest.runner import run_process_group
from lightspeed.core.zero.config import NVME_PATH_ENV


def test_zero2_on_two_cpu_processes_is_ready(capsys):
    assert main(["test", "--strategy", "zero2", "--devices", "2", "--accelerator", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "lightspeed test: zero2 on 2 CPU processes (gloo), 3 steps, precision 32-true"
    checks = [line for line in out if line.startswith("  ")]
    assert [line.split()[0] for line in checks] == ["PASS"] * 7
    assert any("final weights agree across ranks: sha256" in line for line in checks)
    assert out[-1] == "READY: zero2 trains on this machine with 2 processes and they agree."


def test_zero3_with_the_optimizer_offloaded_on_two_cpu_processes_is_ready(capsys):
    argv = ["test", "--strategy", "zero3_offload_optimizer", "--devices", "2", "--accelerator", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "lightspeed test: zero3_offload_optimizer on 2 CPU processes (gloo), 3 steps, precision 32-true"
    checks = [line for line in out if line.startswith("  ")]
    assert any(line.split()[0] == "PASS" and "DeepSpeed cpu_adam op usable" in line for line in checks)
    assert all(line.split()[0] == "PASS" for line in checks)
    assert out[-1] == "READY: zero3_offload_optimizer trains on this machine with 2 processes and they agree."


def test_a_run_that_breaks_fails_with_the_cause(capsys, tmp_path):
    # --keep DIR of an earlier run: its results and logs must not be read as this run's
    stale = _result(0)
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(stale | {"rank": rank}))
    (tmp_path / "logs" / "old").mkdir(parents=True)
    (tmp_path / "logs" / "old" / "stderr.log").write_text("fatal error: libaio.h: No such file or directory")
    # fp16 has no CPU kernels in DeepSpeed: every rank stops in Trainer(...) with the strategy's message
    assert (
        main(
            [
                "test",
                "--strategy",
                "zero2",
                "--devices",
                "2",
                "--accelerator",
                "cpu",
                "--precision",
                "16-mixed",
                "--keep",
                str(tmp_path),
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "  FAIL  the run finished: exit code 1: " in out
    assert "`precision='16-mixed'` needs a CUDA GPU" in out
    assert "  FAIL  processes started: ranks [] of 2" in out  # the stale rank files were removed before launching
    assert "libaio" not in out and not (tmp_path / "logs" / "old").exists()
    assert out.rstrip().splitlines()[-1] == "NOT READY: 2 check(s) failed for zero2."
    assert list(tmp_path.glob("logs/*/attempt_0/*/stderr.log"))  # this run's logs are kept


_HANGING_LAUNCHER = """
import signal, subprocess, sys, time
from pathlib import Path
pid_file = Path(sys.argv[1])
worker = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
          "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)")
subprocess.Popen([sys.executable, "-c", worker, str(pid_file)])  # a worker that even ignores SIGTERM
while not pid_file.exists() or not pid_file.read_text():
    time.sleep(0.05)
print("worker started", flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie waiting to be reaped has exited


def test_a_hung_launch_is_killed_with_all_its_workers(tmp_path):
    pid_file = tmp_path / "worker.pid"
    started = time.monotonic()
    proc = run_process_group(
        [sys.executable, "-c", _HANGING_LAUNCHER, str(pid_file)], dict(os.environ), timeout=8, grace=1
    )
    assert proc.returncode == 124
    assert proc.stdout == "worker started\n"  # output up to the timeout is kept for the diagnosis
    assert proc.stderr.endswith("\nTimed out after 8 s")
    assert time.monotonic() - started < 30
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker), "the launcher's worker outlived the timeout"


def _result(rank: int) -> dict:
    return {
        "rank": rank,
        "world_size": 2,
        "steps": 3,
        "losses": [1.0, 0.9, 0.8],
        "initial_weights": "a" * 64,
        "final_weights": "b" * 64,
        "rng_after_seed": {"torch": [0.1]},
        "rng_after_training": "c" * 64,
    }


def test_rank_comparison_passes_when_everything_agrees():
    checks = compare_ranks([_result(0), _result(1)], world_size=2, steps=3)
    assert len(checks) == 7 and all(check.passed for check in checks)


@pytest.mark.parametrize(
    ("key", "value", "failing"),
    [
        ("final_weights", "d" * 64, "final weights agree across ranks"),
        ("initial_weights", "e" * 64, "initial weights agree across ranks"),
        ("rng_after_seed", {"torch": [0.2]}, "RNG agrees across ranks after seeding (torch, numpy, python)"),
        ("rng_after_training", "f" * 64, "RNG agrees across ranks after training"),
        ("losses", [1.0, math.nan, 0.8], "trained 3 steps with finite losses"),
        ("steps", 2, "trained 3 steps with finite losses"),
    ],
)
def test_rank_comparison_names_the_check_and_the_rank_that_differs(key, value, failing):
    odd = copy.deepcopy(_result(1))
    odd[key] = value
    checks = {check.name: check for check in compare_ranks([_result(0), odd], world_size=2, steps=3)}
    failed = [name for name, check in checks.items() if not check.passed]
    assert failed == [failing]
    if "agree" in failing:
        assert checks[failing].detail == "rank(s) [1] differ from rank 0"


def test_missing_rank_and_unchanged_weights_fail():
    checks = {c.name: c for c in compare_ranks([_result(0)], world_size=2, steps=3)}
    assert not checks["processes started"].passed and checks["processes started"].detail == "ranks [0] of 2"
    frozen = _result(0) | {"final_weights": "a" * 64}
    checks = {
        c.name: c for c in compare_ranks([frozen, _result(1) | {"final_weights": "a" * 64}], world_size=2, steps=3)
    }
    assert not checks["optimizer changed the weights"].passed


@pytest.mark.parametrize(
    ("log", "fix"),
    [
        ("RuntimeError: Ninja is required to load C++ extensions", "pip install ninja"),
        (
            "/bin/sh: 1: c++: not found\nRuntimeError: Error building extension 'cpu_adam'",
            "apt-get install build-essential",
        ),
        ("error: command 'g++' failed: No such file or directory", "apt-get install build-essential"),
        ("fatal error: libaio.h: No such file or directory", "apt-get install libaio-dev"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "ran out of memory"),
    ],
)
def test_known_causes_come_with_their_fix(log, fix):
    assert fix in diagnose(log)


def test_unknown_failure_has_no_made_up_fix():
    assert diagnose("ValueError: something nobody anticipated") is None


def test_bad_arguments_exit_2(capsys, monkeypatch):
    monkeypatch.delenv(NVME_PATH_ENV, raising=False)
    assert main(["test", "--strategy", "zero2_ofload"]) == 2
    assert "Unknown strategy 'zero2_ofload'. Did you mean 'zero2_offload'?" in capsys.readouterr().err
    assert main(["test", "--strategy", "zero3_nvme", "--accelerator", "cpu"]) == 2
    assert (
        "zero3_nvme offloads to NVMe: pass --nvme-path DIR (a directory on an NVMe drive) or set "
        "LIGHTSPEED_NVME_PATH." in capsys.readouterr().err
    )
    assert main(["test", "--steps", "0", "--accelerator", "cpu"]) == 2
    assert "--steps must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_the_cuda_accelerator_without_a_gpu_is_a_usage_error(capsys):
    for given in ("cuda", "gpu"):  # "gpu": Lightning's alias of "cuda", read as "cuda"
        assert main(["test", "--accelerator", given]) == 2
        assert capsys.readouterr().err == (
            "lightspeed test: error: --accelerator cuda, but no CUDA GPU is visible here. Use --accelerator cpu.\n"
        )
