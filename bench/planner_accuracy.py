"""Accuracy of the memory planner on the CPU: measured peak RSS growth / estimate, for ZeRO-2 and ZeRO-3 in one run.

Launches ``tests/strategies/scripts/zero_auto_rss.py`` on 2 ranks (torchrun, gloo): each rank trains a
``--depth`` x (``--width`` x ``--width``) fp32 MLP for 2 steps with ZeRO-2, then ZeRO-3, and records how far its
resident memory rose above the baseline before each run (VmHWM - VmRSS). The baseline named in the ratio is the
planner's per-process estimate for the same model and cluster (``lightspeed.core.zero.planner.estimate_option``: the
device states plus this process's share of host memory, since on the CPU both are host memory). A ratio of 1.0
means the estimate is exact; above 1 the run needed more than planned (activations and the DeepSpeed-on-CPU
extras that tests/strategies/test_zero_auto_memory.py derives, about 1.6-1.8 x for ZeRO-3 today).

    python bench/planner_accuracy.py                      # 50M parameters (about 1.5 GB per rank at the peak)
    python bench/planner_accuracy.py --width 1024 --depth 8   # quick run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from _support.launch import run_torchrun  # noqa: E402
from lightspeed.core.zero.planner import ZERO_OPTIONS, Accounting, Cluster, count_parameters, estimate_option  # noqa: E402

DEVICES = 2
MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()

    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.depth)])
    counts = count_parameters(model)
    with tempfile.TemporaryDirectory() as tmp:
        run_torchrun(
            REPO / "tests" / "strategies" / "scripts" / "zero_auto_rss.py",
            DEVICES,
            [tmp, "2,3", "--width", args.width, "--depth", args.depth, "--batch", args.batch],
        )
        results = [json.loads(path.read_text()) for path in sorted(Path(tmp).glob("rank*_stage*.json"))]

    print(f"model: {counts.total_params / 1e6:.1f}M parameters, fp32, AdamW, {DEVICES} CPU ranks, 2 steps")
    header = f"{'option':<7} {'estimate MiB':>13} {'device MiB':>11}"
    print(f"{header} {'measured MiB (per rank)':>24} {'measured/estimate':>18}")
    for stage in (2, 3):
        option = next(o for o in ZERO_OPTIONS if o.name == f"zero{stage}")
        estimate = estimate_option(option, counts, Cluster(DEVICES), Accounting(precision="32-true"))
        per_process = estimate.device.total + estimate.host.total / DEVICES
        grown = [(r["peak_kib"] - r["baseline_kib"]) * 1024 for r in results if r["stage"] == stage]
        measured = ", ".join(f"{g / MIB:.0f}" for g in grown)
        print(
            f"{option.name:<7} {per_process / MIB:>13.0f} {estimate.device.total / MIB:>11.0f} {measured:>24} "
            f"{max(grown) / per_process:>17.2f}x"
        )


if __name__ == "__main__":
    main()
