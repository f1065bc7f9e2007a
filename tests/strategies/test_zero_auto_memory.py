"""Measured against estimated: the peak resident memory of a short 2-rank CPU ZeRO-2 run of a 50M-parameter MLP
lies between the model states the planner puts on each device and its whole per-process estimate plus activations.

On the CPU the "device" is host memory, so each process needs its device states plus its share of the node's host
memory (the fp32 model each process builds, times DeepSpeed's buffer factor 1.5). The margin on top covers what
neither DeepSpeed's estimator nor ours counts: activations (batch x width x layers, computed below) and ZeRO-2's
communication buffers (reduce and all-gather buckets of hidden_size^2 elements each, the "auto" size lightspeed
resolves), plus 32 MiB for allocator rounding and gloo's own buffers.
"""

from __future__ import annotations

import json

import pytest
import torch

from _support.launch import REPO_ROOT, run_torchrun
from lightspeed.core.memory import ZERO_OPTIONS, Accounting, Cluster, count_parameters, estimate_option

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_auto_rss.py"
WIDTH, DEPTH, BATCH, DEVICES = 2048, 12, 2, 2


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("zero_rss")
    run_torchrun(SCRIPT, DEVICES, [out, "2", "--width", WIDTH, "--depth", DEPTH, "--batch", BATCH])
    return [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]


def test_zero2_peak_rss_is_within_the_estimate_plus_activations(measured):
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    counts = count_parameters(model)
    assert 50_000_000 < counts.total_params < 51_000_000
    option = next(o for o in ZERO_OPTIONS if o.name == "zero2")
    estimate = estimate_option(option, counts, Cluster(DEVICES), Accounting(precision="32-true"))
    per_process = estimate.device.total + estimate.host.total / DEVICES
    activations = BATCH * WIDTH * (DEPTH + 1) * 4 * 2  # layer outputs and their gradients, fp32
    buckets = 2 * WIDTH * WIDTH * 4  # reduce + all-gather buckets of hidden^2 fp32 elements
    margin = activations + buckets + 32 * 2**20
    assert len(measured) == DEVICES
    for rank in measured:
        assert rank["steps"] == 2
        grown = (rank["peak_kib"] - rank["baseline_kib"]) * 1024
        assert grown <= per_process + margin, (
            f"peak grew {grown / 2**20:.0f} MiB, more than the estimate {per_process / 2**20:.0f} MiB + "
            f"{margin / 2**20:.0f} MiB"
        )
        # and the estimate is not vacuous: at least the model states it puts on the device were really allocated
        assert grown >= estimate.device.total, f"peak grew only {grown / 2**20:.0f} MiB"
