"""Time per optimizer step of ``unused_parameters="skip"`` (the default) and ``"zero_gradient"`` against DeepSpeed
alone (baseline ``deepspeed``: lightspeed's parameter-use tracking not installed, so ranks that use different
parameters would go wrong silently), 2 CPU ranks (gloo), Fabric loop, AdamW, all in the same run:

* ``dense``: an MLP whose every parameter is used in every step, under ``zero1`` and ``zero2``: what every run pays
  (a gradient hook per parameter, one all-reduce of one int per parameter per step, under ZeRO-2 one more per
  backward);
* ``moe``: 16 experts of which each step's tokens reach 4 (the same on both ranks), under ``zero1``: the unused
  experts' slices are kept and put back, and those skipped before are stepped again with their own Adam step count.

    python bench/unused_parameters.py                   # re-launches itself with torchrun on 2 ranks
    python bench/unused_parameters.py --steps 30 --hidden 512 --repeats 3

The variants alternate ``--repeats`` times and the median step time of each is compared. In ``dense`` all compute the
same update: the script prints their largest weight difference from the baseline as a check. ``zero_gradient`` keeps
what every run needs for correct sums (ZeRO-1: a zero gradient for each parameter without one; ZeRO-2: the check that
the ranks used the same parameters); ``skip`` adds leaving the unused parameters alone.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
MODES = ("deepspeed", "zero_gradient", "skip")
CASES = (("dense", "zero1"), ("dense", "zero2"), ("moe", "zero1"))
EXPERTS, REACHED = 16, 4


class Experts(nn.Module):
    """A block of ``EXPERTS`` MLPs; step ``s`` routes every token to ``REACHED`` of them (the same on every rank)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        chosen = [(step * REACHED + i) % EXPERTS for i in range(REACHED)]
        return x + sum(torch.tanh(self.experts[i](x)) for i in chosen) / REACHED


class Net(nn.Module):
    """``layers`` blocks: linear layers (``dense``) or :class:`Experts` (``moe``)."""

    def __init__(self, case: str, hidden: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.moe = case == "moe"
        self.blocks = nn.ModuleList(Experts(hidden) if self.moe else nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, step) if self.moe else torch.tanh(block(x))
        return x


def time_mode(case: str, name: str, mode: str, args: argparse.Namespace) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Seconds per optimizer step (the first, with set-up, dropped) and the final weights."""
    import lightning as L

    from lightspeed.core.zero import engine as lightspeed_engine
    from lightspeed.fabric import ZeroFabricStrategy

    # the baseline: no tracking installed on the engine (what DeepSpeed does by itself)
    track = lightspeed_engine.leave_unused_parameters
    if mode == "deepspeed":
        lightspeed_engine.leave_unused_parameters = lambda *args, **kwargs: None  # type: ignore[assignment]
    strategy = ZeroFabricStrategy(stage=int(name[-1]), unused_parameters="skip" if mode == "deepspeed" else mode)
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    model = Net(case, args.hidden, args.layers)
    engine, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01))
    gen = torch.Generator().manual_seed(1 + fabric.global_rank)
    stamps = []
    for step in range(args.steps + 1):
        x = torch.randn(args.batch, args.hidden, generator=gen)
        optimizer.zero_grad()
        fabric.backward(engine(x, step).square().mean())
        optimizer.step()
        stamps.append(time.perf_counter())
    lightspeed_engine.leave_unused_parameters = track
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)], weights


def worker(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    for case, name in CASES:
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        weights: dict[str, dict[str, torch.Tensor]] = {}
        for _ in range(args.repeats):
            for mode in MODES:
                steps, weights[mode] = time_mode(case, name, mode, args)
                times[mode] += steps
        if rank != 0:
            continue
        median = {mode: statistics.median(values) for mode, values in times.items()}
        line = f"{case:5s} {name}: " + ", ".join(f"{mode} {median[mode] * 1e3:7.1f} ms/step" for mode in MODES)
        if case == "dense":
            base = weights["deepspeed"]
            drift = max((weights[m][k] - base[k]).abs().max().item() for m in MODES for k in base)
            line += f", max |w - w_deepspeed| = {drift:.1e}"
        print(line)
        for mode in MODES[1:]:
            print(f"  ratio {mode} / deepspeed: {median[mode] / median['deepspeed']:.3f} (time per step)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="micro-batch size per rank")
    parser.add_argument("--repeats", type=int, default=3)
    args, _ = parser.parse_known_args()
    if "LOCAL_RANK" in os.environ:
        worker(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={port}",
        __file__,
        *sys.argv[1:],
    ]
    raise SystemExit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
