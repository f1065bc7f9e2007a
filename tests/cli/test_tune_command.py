"""``lightspeed tune``: one real launch on 2 CPU ranks measures the allowed options (and a micro-batch size), prints
the table and the choice, and writes the decision ``ZeroAutoStrategy(tune=True)`` reads; a factory that returns no job
and malformed flags are exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from _support.launch import REPO_ROOT, child_env
from lightspeed.cli.main import main
from lightspeed.core.zero.tuner.decision import TUNE_MARGIN

COMMAND = [sys.executable, "-m", "lightspeed.cli.main", "tune", "cli.scripts.tune_job:job"]


def test_tune_measures_prints_and_caches_the_fastest_option(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    args = ["--devices", "2", "--accelerator", "cpu", "--steps", "1", "--options", "zero1,zero2", "--cache", str(cache)]
    args += ["--micro-batches", "2", "--accumulate", "2"]  # the job's batch_size=4: 8 samples per rank and step
    proc = subprocess.run(
        [*COMMAND, *args], cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300, check=False
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    table = output.split("lightspeed zero_auto: measured 1 step of each candidate\n", 1)[1].splitlines()[1:5]
    speeds = {row.split()[0]: float(row.split()[1]) for row in table}
    assert list(speeds) == ["zero1", "zero1+micro_batch_2", "zero2", "zero2+micro_batch_2"]
    fastest = max(speeds, key=lambda name: speeds[name])
    # the planner's choice (zero1 at the job's own size) is kept unless another was measured TUNE_MARGIN times as fast
    chosen = fastest if speeds[fastest] >= TUNE_MARGIN * speeds["zero1"] else "zero1"
    option, _, micro = chosen.partition("+micro_batch_")
    batching = " with micro-batches of 2 and accumulate_grad_batches=4" if micro else ""
    assert f"lightspeed tune: {option}{batching} (decision in {cache})" in proc.stdout
    (entry,) = json.loads(cache.read_text())["entries"].values()
    assert entry["chosen"] == chosen and entry["key"]["world_size"] == 2
    assert entry["key"]["micro_batch"] == 4 and entry["key"]["accumulation"] == 2


def test_a_factory_that_returns_no_job_is_a_usage_error(capsys, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT / "tests"))
    assert main(["tune", "cli.scripts.tune_job:not_a_job"]) == 2
    assert capsys.readouterr().err.strip() == (
        "lightspeed tune: error: cli.scripts.tune_job:not_a_job returned RegressionModule; it must return "
        "(LightningModule, DataLoader or DataModule)."
    )


def test_malformed_tuning_flags_are_usage_errors(capsys) -> None:
    assert main(["tune", "cli.scripts.tune_job:job", "--micro-batches", "4,eight"]) == 2
    assert capsys.readouterr().err.strip() == (
        "lightspeed tune: error: --micro-batches takes sizes such as 2,4,8; got '4,eight'."
    )
    assert main(["tune", "cli.scripts.tune_job:job", "--accumulate", "0"]) == 2
    assert capsys.readouterr().err.strip() == "lightspeed tune: error: --accumulate must be at least 1, got 0."
