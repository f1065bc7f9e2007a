"""Measured against planned: the peak resident memory of short 2-rank CPU runs of a 50M-parameter MLP (12 fp32
Linear layers of 2048 x 2048, batch 2, AdamW, 2 steps) under zero2, zero3, zero3_offload and zero3_nvme is within
+-15 % of the planner's per-process estimate (``OptionEstimate.cpu_process_peak``, what ``lightspeed estimate``
prints per process and ``zero_auto`` plans with on the CPU).

All options are measured in the same two processes, one after the other (one launch); each run's growth is taken
from a baseline read after the previous run, so memory the previous run keeps is not charged to the next. The same
measurement at 403M parameters, one launch per option, is ``bench/planner_accuracy.py --width 4096 --depth 24``.
"""

from __future__ import annotations

import json

import pytest
import torch

from _support.launch import REPO_ROOT, run_torchrun
from lightspeed.core.zero.planner import ZERO_OPTIONS, Accounting, Cluster, count_parameters, estimate_option
from lightspeed.core.zero.runtime import async_io_problem

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_auto_rss.py"
WIDTH, DEPTH, BATCH, DEVICES = 2048, 12, 2, 2
OPTIONS = ("zero2", "zero3", "zero3_offload", "zero3_nvme")
TOLERANCE = 0.15
MIB = 2**20


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("zero_rss")
    options = [name for name in OPTIONS if name != "zero3_nvme" or async_io_problem() is None]
    run_torchrun(SCRIPT, DEVICES, [out, ",".join(options), "--width", WIDTH, "--depth", DEPTH, "--batch", BATCH])
    return {name: [json.loads(path.read_text()) for path in sorted(out.glob(f"rank*_{name}.json"))] for name in options}


def _estimate(name: str):
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    counts = count_parameters(model)
    assert 50_000_000 < counts.total_params < 51_000_000
    option = next(o for o in ZERO_OPTIONS if o.name == name)
    return estimate_option(option, counts, Cluster(DEVICES), Accounting(precision="32-true"))


@pytest.mark.parametrize("name", OPTIONS)
def test_peak_rss_per_rank_is_within_15_percent_of_the_plan(measured, name):
    if name not in measured:
        pytest.skip(f"NVMe offload cannot run here: {async_io_problem()}")
    planned = _estimate(name).cpu_process_peak
    ranks = measured[name]
    assert len(ranks) == DEVICES
    for rank in ranks:
        assert rank["steps"] == 2
        grown = rank["peak_bytes"] - rank["baseline_bytes"]
        assert abs(grown / planned - 1) <= TOLERANCE, (
            f"{name}: the peak grew {grown / MIB:.0f} MiB, the planner's estimate is {planned / MIB:.0f} MiB "
            f"({grown / planned:.2f} x)"
        )
