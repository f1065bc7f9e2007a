"""A rank that stops under Ray Train is named, as under torchrun: Ray creates the workers' process group, lightspeed
watches it (a heartbeat on its own connection to the group's store), so the Trainer's and Fabric's collectives that
time out after the group's timeout (Ray's ``TorchConfig(timeout_s=)``, also for DeepSpeed's own groups) raise
``CollectiveTimeoutError`` naming the stopped rank, and ``TorchTrainer.fit`` reports that error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("ray.train", reason="needs Ray Train: pip install 'lightspeed[ray]'")

from _support.launch import REPO_ROOT, run_python  # noqa: E402
from _support.ray_train import HANG_TIMEOUT_S  # noqa: E402

SCRIPTS = {"trainer": ("ray_fit.py", [2, 1]), "fabric": ("ray_fabric.py", [2, 8])}  # ZeRO-2; epochs / steps


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
def test_a_stopped_worker_is_named_after_the_ray_process_groups_timeout(tmp_path: Path, front_end: str) -> None:
    script, arguments = SCRIPTS[front_end]
    run_python(REPO_ROOT / "tests" / "ray" / "scripts" / script, [tmp_path, *arguments, "hang"], timeout=300)
    error = json.loads((tmp_path / "error_rank0.json").read_text())
    assert error["type"] == "CollectiveTimeoutError", error
    assert re.fullmatch(
        rf"Rank 0 waited {HANG_TIMEOUT_S}s \(the timeout of the process group, which was created outside lightspeed: "
        r"under Ray Train set it with TorchConfig\(timeout_s=\.\.\.\)\) in `torch\.distributed\.all_reduce`: rank 1 "
        r"did not arrive \(rank 1: no heartbeat for [\d.]+s \(stopped, dead or hung in native code\)\)\. .*"
        rf"Timed out waiting {HANG_TIMEOUT_S}000ms.*",
        error["message"],
        flags=re.DOTALL,
    ), error["message"]
    driver = json.loads((tmp_path / "driver_error.json").read_text())
    # Ray passes the named error on (its snippet of the worker's traceback keeps the head and the tail)
    assert driver["type"] == "WorkerGroupError" and "rank 1 did not arrive" in driver["message"], driver
    assert not (tmp_path / "error_rank1.json").exists()  # the stopped worker never got to raise
