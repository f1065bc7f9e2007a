"""scripts/gpu_check.sh, the CUDA checks run on a lent GPU machine: its dry run on the CPU goes through every phase
and reports the gpu tests as skipped, and its report reads pytest's JUnit file and the benchmark's JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _support.launch import REPO_ROOT, child_env

SCRIPT = REPO_ROOT / "scripts" / "gpu_check.sh"
REPORT = REPO_ROOT / "scripts" / "gpu_check_report.py"

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.strategies.test_zero_gpu" name="test_a[zero2-32-true]" time="2.5"/>
<testcase classname="tests.strategies.test_zero_gpu" name="test_a[zero2-16-mixed]" time="0.1">
<failure message="AssertionError: (0.2, [0])">check_run failed</failure></testcase>
<testcase classname="tests.fabric.test_fabric_gpu" name="test_b" time="0">
<skipped message="needs a CUDA GPU"/></testcase>
</testsuite></testsuites>
"""


def test_report_reads_outcomes_failures_and_ratios(tmp_path: Path) -> None:
    (tmp_path / "junit.xml").write_text(JUNIT)
    rates = {"trainer": [90.0, 100.0, 110.0], "engine": [100.0, 100.0, 100.0], "lightning": [90.0, 125.0, 100.0]}
    record = {"args": {"devices": 1}, "rows": [{"name": "zero2", "samples_per_s": rates}]}
    (tmp_path / "throughput.json").write_text(json.dumps(record))
    subprocess.run([sys.executable, str(REPORT), str(tmp_path), "setup=0:31", "tests=1:107"], check=True)
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["phases"] == {"setup": {"exit": 0, "seconds": 31}, "tests": {"exit": 1, "seconds": 107}}
    assert result["tests"]["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    failed = result["tests"]["cases"]["tests.strategies.test_zero_gpu::test_a[zero2-16-mixed]"]
    assert failed["outcome"] == "failed" and failed["message"] == "AssertionError: (0.2, [0])\ncheck_run failed"
    # medians of the per-repeat ratios: trainer/engine 0.9, 1.0, 1.1; trainer/lightning 1.0, 0.8, 1.1
    assert result["throughput"]["samples_per_s"]["zero2"] == {
        "trainer": 100.0,
        "engine": 100.0,
        "lightning": 100.0,
        "trainer/engine": 1.0,
        "trainer/lightning": 1.0,
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script runs the real checks (minutes)")
def test_dry_run_on_the_cpu_goes_through_every_phase(tmp_path: Path) -> None:
    env = child_env({"PYTHON": sys.executable, "OUT": ""})
    env.pop("GPU_CHECK_WHEELS", None)
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "no CUDA device visible: a dry run" in proc.stdout
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["device"]["gpus"] == 0
    assert {name: phase["exit"] for name, phase in result["phases"].items()} == {"setup": 0, "tests": 0, "bench": 0}
    counts = result["tests"]["counts"]
    # every gpu test is collected and skipped: the Trainer's and Fabric's 18-run matrices at least
    assert counts["skipped"] >= 36 and counts["passed"] == counts["failed"] == counts["error"] == 0
    row = result["throughput"]["samples_per_s"]["zero2"]
    assert {"trainer", "engine", "lightning", "fabric", "trainer/engine"} <= set(row)
    assert os.path.getsize(tmp_path / "bench.log") > 0
