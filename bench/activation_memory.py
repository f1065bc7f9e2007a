"""Peak host memory of a training step with and without ``activation_checkpointing_policy``, on a model whose
activations dominate its memory, through the real Fabric ZeRO strategy on 2 CPU ranks.

The model: ``--blocks`` residual MLP blocks (LayerNorm, Linear width -> 4 x width, GELU, Linear back) on a batch of
``--batch`` x ``--seq`` tokens of width ``--width`` (default 8 blocks, width 256, 8 x 512 tokens: 4.2M parameters,
about 17 MiB of fp32 weights, but about 40 MiB of activations per block kept for the backward pass on each rank).
The checkpointed variant is the same run with ``ZeroFabricStrategy(activation_checkpointing_policy={Block})``.

How peak memory is measured: each variant runs in its own launch; each rank resets its peak resident size (Linux:
``5`` written to ``/proc/self/clear_refs`` resets ``VmHWM``) just before a training step (forward, backward, optimizer
step), and the step's peak is ``VmHWM`` afterwards minus ``VmRSS`` just before. The workers run with glibc's
``MALLOC_MMAP_THRESHOLD_=65536`` (both variants alike), so every freed tensor above 64 KiB leaves the resident set at
once and the growth is the step's peak of live tensors (activations, gradients, optimizer temporaries) rather than
the allocator's reuse of pages a previous step left. The first step is a warm-up (DeepSpeed's buffers); the peak is
the largest over the measured steps and both ranks, the median over ``--repeats`` alternating launches.

Also printed: what autograd saves for one block (every tensor saved for the backward pass of one block's forward,
measured with ``torch.autograd.graph.saved_tensors_hooks``, each storage once) and the input each checkpointed block
keeps instead, the losses of both variants (equal: checkpointing recomputes the same values) and the step times.

    python bench/activation_memory.py                  # zero2, 8 blocks, about a minute on 2 idle cores
    python bench/activation_memory.py --stage 3 --blocks 12 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _support.process_memory import reset_peak, status_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def build(blocks: int, width: int) -> tuple[type, Any]:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*(Block() for _ in range(blocks)))
            self.head = nn.Linear(width, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(x))

    torch.manual_seed(0)
    return Block, Model()


def saved_by_one_block(block_class: type, shape: tuple[int, ...]) -> int:
    """Bytes of activations autograd keeps for the backward pass of one block (each storage once, weights not
    counted)."""
    import torch

    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    block = block_class()
    x = torch.randn(shape, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        block(x)
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    return sum(nbytes for pointer, nbytes in storages.items() if pointer not in weights)


def worker(variant: str, args: argparse.Namespace, out: Path) -> None:
    import lightning as L
    import torch

    import lightspeed

    block_class, model = build(args.blocks, args.width)
    policy = {block_class} if variant == "checkpointed" else None
    strategy = lightspeed.fabric.ZeroFabricStrategy(stage=args.stage, activation_checkpointing_policy=policy)
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=args.devices)
    fabric.launch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    generator = torch.Generator().manual_seed(fabric.global_rank)
    x = torch.randn(args.batch, args.seq, args.width, generator=generator)
    y = torch.randn(args.batch, args.seq, 1, generator=generator)
    peaks, seconds, losses = [], [], []
    for step in range(args.steps + 1):
        fabric.barrier()
        reset_peak()
        before = status_bytes("VmRSS")
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step > 0:  # the first step is a warm-up
            seconds.append(time.perf_counter() - start)
            peaks.append(status_bytes("VmHWM") - before)
        losses.append(float(loss))
    results: list[dict] = [{}] * fabric.world_size
    torch.distributed.all_gather_object(results, {"peak": max(peaks), "seconds": statistics.median(seconds)})
    if fabric.global_rank == 0:
        saved = saved_by_one_block(block_class, (args.batch, args.seq, args.width))
        out.write_text(json.dumps({"ranks": results, "losses": losses, "saved_per_block": saved}))


def launch(variant: str, args: argparse.Namespace, port: int) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={args.devices}",
        f"--master_port={port}",
    ]
    command += [__file__, "--worker", variant, out.as_posix(), *sys.argv[1:]]
    subprocess.run(command, env=env, check=True, capture_output=True)
    result = json.loads(out.read_text())
    out.unlink()
    return result


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=2, help="ZeRO stage (default 2)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=3, help="measured steps after one warm-up step")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="alternating launches per variant")
    parser.add_argument("--port", type=int, default=29741)
    return parser.parse_args(argv)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], parse(sys.argv[4:]), Path(sys.argv[3]))
        return
    args = parse(sys.argv[1:])
    variants = ("plain", "checkpointed")
    runs: dict[str, list[dict]] = {variant: [] for variant in variants}
    load = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for variant in variants:
            runs[variant].append(launch(variant, args, args.port))
    load.append(os.getloadavg()[0])

    def median(variant: str, field: str) -> float:
        return statistics.median(max(rank[field] for rank in run["ranks"]) for run in runs[variant])

    params = args.blocks * (8 * args.width * args.width + 7 * args.width) + args.width + 1
    block_input = args.batch * args.seq * args.width * 4
    saved = runs["plain"][0]["saved_per_block"]
    print(
        f"ZeRO-{args.stage}, {args.devices} CPU ranks, {args.blocks} blocks of width {args.width} ({params / 1e6:.1f}M "
        f"parameters, {params * 4 / MIB:.1f} MiB fp32), {args.batch} x {args.seq} tokens per rank; load "
        f"{load[0]:.1f} -> {load[1]:.1f}"
    )
    print(
        f"autograd keeps {saved / MIB:.1f} MiB per block for the backward pass ({args.blocks} blocks: "
        f"{args.blocks * saved / MIB:.1f} MiB); a checkpointed block keeps its input, {block_input / MIB:.1f} MiB "
        f"({args.blocks * block_input / MIB:.1f} MiB), and recomputes one block at a time"
    )
    for variant in variants:
        print(
            f"{variant:12s} peak step memory {median(variant, 'peak') / MIB:7.1f} MiB per rank (worst rank, median of "
            f"{args.repeats}); step {median(variant, 'seconds'):.2f} s; losses "
            + ", ".join(f"{loss:.6f}" for loss in runs[variant][0]["losses"])
        )
    print(
        f"ratio checkpointed / plain: peak memory {median('checkpointed', 'peak') / median('plain', 'peak'):.2f}, "
        f"step time {median('checkpointed', 'seconds') / median('plain', 'seconds'):.2f}"
    )


if __name__ == "__main__":
    main()
