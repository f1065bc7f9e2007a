"""DeepSpeed's low-memory bf16 states (``bf16_master_weights_and_grads``, ``bf16_optimizer_states``): the bytes the
optimizer holds per rank and the accuracy cost, against fp32 master weights (DeepSpeed's default) in the same run.

    python bench/low_memory_states.py                        # ZeRO-2, 2 CPU ranks, MLP 1024 wide, 60 AdamW steps
    python bench/low_memory_states.py --offload cpu --steps 200 --width 2048

Every variant trains the same bf16-mixed model from the same weights on the same batches (the Fabric worker of
``tests/fabric/scripts/zero_low_memory_states.py``). Memory: what the optimizer holds on a rank (its master partitions
and its moments), measured on the tensors. Accuracy: the mean loss of the last 10 steps and the distance of the final
fp32 view of the weights from the fp32-master run's, relative to the weights' size. Without optimizer offload DeepSpeed
keeps bf16 master weights only together with bf16 moments.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "fabric" / "scripts" / "zero_low_memory_states.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--offload", choices=["none", "cpu"], default="none")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    out = Path(tempfile.mkstemp(suffix=".pt")[1])
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29743", str(WORKER)]
    command += [str(out), str(args.stage), args.offload, str(args.steps), str(args.width)]
    subprocess.run(command, env=env, check=True, capture_output=True)
    results = torch.load(out)
    reference = results["fp32_master"]
    base_bytes = reference["master_bytes"] + reference["state_bytes"]
    norm = torch.sqrt(sum(w.square().sum() for w in reference["weights"].values()))
    print(f"ZeRO-{args.stage}, optimizer offload: {args.offload}, MLP {args.width} wide, {args.steps} AdamW steps")
    print(f"{'variant':24s} {'optimizer bytes/rank':>21s} {'vs fp32':>8s} {'last-10 loss':>13s} {'weights off':>12s}")
    for name, result in results.items():
        held = result["master_bytes"] + result["state_bytes"]
        distance = torch.sqrt(sum((result["weights"][k] - w).square().sum() for k, w in reference["weights"].items()))
        loss = sum(result["losses"][-10:]) / len(result["losses"][-10:])
        print(f"{name:24s} {held:21,d} {held / base_bytes:8.2f} {loss:13.5f} {float(distance / norm):12.2e}")
    out.unlink()


if __name__ == "__main__":
    main()
