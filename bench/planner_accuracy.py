"""Accuracy of the memory planner on the CPU: measured peak RSS growth per rank / the planner's estimate, for
``zero2``, ``zero3``, ``zero3_offload`` and ``zero3_nvme``, one launch per option.

Launches ``tests/strategies/scripts/zero_auto_rss.py`` on 2 ranks (torchrun, gloo): each rank trains a
``--depth`` x (``--width`` x ``--width``) fp32 MLP with AdamW for 2 steps under the option, and records how
far its resident memory rose above the baseline before that run (VmHWM - VmRSS). The baseline named in the ratio is
the planner's per-process estimate for the same model and job (``OptionEstimate.cpu_process_peak``: on the CPU the
device states are host memory too), which ``lightspeed estimate`` prints per process and ``zero_auto`` plans with.
1.0 means the estimate is exact; the target is within 0.85-1.15.

    python bench/planner_accuracy.py                              # 50M parameters
    python bench/planner_accuracy.py --width 4096 --depth 24      # 403M parameters (about 9 GB per rank at the peak)
    python bench/planner_accuracy.py --options zero3_nvme --width 8192 --depth 30   # 2.0B, NVMe only
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
    parser.add_argument("--options", default="zero2,zero3,zero3_offload,zero3_nvme")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--nvme-path", default=None, help="where zero3_nvme swaps (default: a temporary folder)")
    args = parser.parse_args()

    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.depth)])
    counts = count_parameters(model)
    names = args.options.split(",")
    results = []
    for name in names:  # one launch each: what one option's engine leaves referenced is not charged to the next
        with tempfile.TemporaryDirectory() as tmp:
            nvme = ["--nvme-path", args.nvme_path] if args.nvme_path else []
            run_torchrun(
                REPO / "tests" / "strategies" / "scripts" / "zero_auto_rss.py",
                DEVICES,
                [tmp, name, "--width", args.width, "--depth", args.depth, "--batch", args.batch, *nvme],
            )
            results += [json.loads(path.read_text()) for path in sorted(Path(tmp).glob("rank*_*.json"))]

    print(f"model: {counts.total_params / 1e6:.1f}M parameters, fp32, AdamW, {DEVICES} CPU ranks, 2 steps")
    print(f"{'option':<14} {'estimate MiB':>13} {'measured MiB (per rank)':>24} {'measured/estimate':>18}")
    for name in names:
        option = next(o for o in ZERO_OPTIONS if o.name == name)
        estimate = estimate_option(option, counts, Cluster(DEVICES), Accounting(precision="32-true"))
        per_process = estimate.cpu_process_peak
        grown = [r["peak_bytes"] - r["baseline_bytes"] for r in results if r["option"] == name]
        measured = ", ".join(f"{g / MIB:.0f}" for g in grown)
        print(f"{name:<14} {per_process / MIB:>13.0f} {measured:>24} {max(grown) / per_process:>17.2f}x")


if __name__ == "__main__":
    main()
