"""Measured against estimated: the peak resident memory of short 2-rank CPU ZeRO-2 and ZeRO-3 runs of a 50M-parameter
MLP (12 fp32 Linear layers of 2048 x 2048, batch 2, AdamW, 2 steps) lies between the model states the planner puts on
each device and its whole per-process estimate plus a margin derived term by term below.

Both stages are measured in the same two processes, one after the other (one launch); each run's growth is taken
from a baseline read after the previous run, so memory the previous run keeps is not charged to the next.

On the CPU the "device" is host memory, so each process needs its device states plus its share of the node's host
memory (the fp32 model each process builds, times DeepSpeed's buffer factor 1.5):
``per_process = device.total + host.total / 2``. Notation: ``N`` parameters, ``M = 4 N`` bytes (the fp32 model),
``P = 4 N / 2`` bytes (one fp32 partition), ``L`` = the largest layer's parameters.

ZeRO-2 margin (not counted by DeepSpeed's estimator nor ours):
  - activations: layer outputs and their gradients, ``batch x width x (layers + 1) x 4 bytes x 2``;
  - communication buckets: reduce and all-gather buckets of ``hidden^2`` fp32 elements each (the "auto" size);
  - 32 MiB for allocator rounding and gloo's buffers.

ZeRO-3 margin: DeepSpeed 0.19.8 on the CPU holds more than its estimator counts. Each extra, from the model's numbers:
  - the gathered parameters: the estimate counts the largest layer gathered (``4 L``, twice); measured, the RSS
    grows by ~0.9 M during the first forward, as the fully gathered fp32 layers stay resident until backward
    (``stage3_max_live_parameters`` defaults to 1e9 elements, more than the model): ``+ M``;
  - a fourth partition-sized buffer: ``fp16_partitioned_groups_flat`` (the weights, fp32 here),
    ``fp32_partitioned_groups_flat`` (the master copy), ``grad_partitions_flat_buffer`` and ``lp_param_buffer``,
    where the estimator counts three: ``+ P``;
  - the optimizer step's temporaries: ``_prepare_fp32_grad_for_sub_group`` flattens the gradient partition into a
    new tensor (``P``) and torch AdamW's single-tensor step builds its denominator as ``exp_avg_sq.sqrt()`` and then
    a quotient (``2 P`` at once); measured, RSS peaks 3 P above the state before the step: ``+ 3 P``;
  - the original fp32 module is never freed on the CPU (``M``): already inside the estimate's host term
    ``1.5 M``, so nothing is added for it;
  - activations and buckets as for ZeRO-2 (reduce bucket and prefetch bucket, ``hidden^2`` fp32 elements each);
  - 192 MiB for allocator rounding, glibc arenas of gloo's threads and fragmentation: in one run the two ranks'
    peaks differ by up to ~130 MiB, and the highest peak seen was 55 MiB under a 64 MiB constant; 192 MiB covers
    that spread once more, so a noisy machine does not fail the test while a real regression (hundreds of MiB)
    still does.

Measured (this machine, DeepSpeed 0.19.8, torch 2.13): estimate 800 MiB, of which 512 MiB device states; growth
1290-1418 MiB over 3 launches; the bound is the estimate + 609 MiB of extras (M = 192 MiB, P = 96 MiB, buckets
32 MiB, activations 0.4 MiB) + 192 MiB = 1601 MiB. ``bench/planner_accuracy.py`` prints measured / estimate.
"""

from __future__ import annotations

import json

import pytest
import torch

from _support.launch import REPO_ROOT, run_torchrun
from lightspeed.core.zero.planner import ZERO_OPTIONS, Accounting, Cluster, count_parameters, estimate_option

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_auto_rss.py"
WIDTH, DEPTH, BATCH, DEVICES = 2048, 12, 2, 2
FP32 = 4
MIB = 2**20


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict]]:
    out = tmp_path_factory.mktemp("zero_rss")
    run_torchrun(SCRIPT, DEVICES, [out, "2,3", "--width", WIDTH, "--depth", DEPTH, "--batch", BATCH])
    return {
        stage: [json.loads(path.read_text()) for path in sorted(out.glob(f"rank*_stage{stage}.json"))]
        for stage in (2, 3)
    }


def _counts():
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    counts = count_parameters(model)
    assert 50_000_000 < counts.total_params < 51_000_000
    return counts


def _estimate(name: str):
    option = next(o for o in ZERO_OPTIONS if o.name == name)
    return estimate_option(option, _counts(), Cluster(DEVICES), Accounting(precision="32-true"))


def _activations() -> int:
    return BATCH * WIDTH * (DEPTH + 1) * FP32 * 2  # layer outputs and their gradients, fp32


def _check(ranks: list[dict], estimate, margin: int) -> None:
    per_process = estimate.device.total + estimate.host.total / DEVICES
    assert len(ranks) == DEVICES
    for rank in ranks:
        assert rank["steps"] == 2
        grown = (rank["peak_kib"] - rank["baseline_kib"]) * 1024
        assert grown <= per_process + margin, (
            f"ZeRO-{rank['stage']}: peak grew {grown / MIB:.0f} MiB, more than the estimate "
            f"{per_process / MIB:.0f} MiB + {margin / MIB:.0f} MiB"
        )
        # and the estimate is not vacuous: at least the model states it puts on the device were really allocated
        assert grown >= estimate.device.total, f"ZeRO-{rank['stage']}: peak grew only {grown / MIB:.0f} MiB"


def test_zero2_peak_rss_is_within_the_estimate_plus_activations(measured):
    buckets = 2 * WIDTH * WIDTH * FP32  # reduce + all-gather buckets of hidden^2 fp32 elements
    _check(measured[2], _estimate("zero2"), _activations() + buckets + 32 * MIB)


def test_zero3_peak_rss_is_within_the_estimate_plus_deepspeed_cpu_extras(measured):
    counts = _counts()
    model_bytes = FP32 * counts.total_params  # M
    partition = FP32 * counts.total_params // DEVICES  # P
    gathered_model = model_bytes  # all layers gathered in fp32 between forward and backward
    fourth_buffer = partition  # lp_param_buffer next to the three partition buffers the estimator counts
    step_temporaries = 3 * partition  # flattened fp32 gradient + Adam's sqrt and quotient
    buckets = 2 * WIDTH * WIDTH * FP32  # reduce + prefetch buckets of hidden^2 fp32 elements
    margin = gathered_model + fourth_buffer + step_temporaries + buckets + _activations() + 192 * MIB
    _check(measured[3], _estimate("zero3"), margin)
