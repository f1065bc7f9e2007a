"""Generation under ZeRO-3: tokens/s of a GPT-2 generating on 2 CPU ranks with the parameters gathered for every
token (what ``synced_gpus=True`` does, lightspeed's default) and gathered once for the whole generation
(``lightspeed.gathered_for_generation``: the whole block, gathering included, and the generation inside it), against
the same model generating in one process.

    python bench/generation_speed.py                       # 8 layers x 512 wide (25M parameters), 32 new tokens
    python bench/generation_speed.py --width 768 --layers 12 --tokens 64 --repeats 5

One intra-op thread per process everywhere. Ranks generate from different prompts with different numbers of new
tokens (the second rank one more), so ``synced_gpus`` has work to do. The variants alternate within each repeat; the
medians are compared. Every variant's tokens are checked against single-process generation.
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

import torch

ROOT = Path(__file__).resolve().parents[1]


def make_model(width: int, layers: int) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=256, n_embd=width, n_layer=layers, n_head=8)
    return GPT2LMHeadModel(config).eval()


def prompt(rank: int) -> torch.Tensor:
    return torch.arange(8).unsqueeze(0) * (rank + 3) % 512


def generate(model: Any, rank: int, tokens: int) -> list[int]:
    ids = prompt(rank)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens + rank, do_sample=False, pad_token_id=0
    )
    return out[0].tolist()


def worker(args: argparse.Namespace, out: Path) -> None:
    import lightning as L

    import lightspeed

    fabric = L.Fabric(strategy="zero3", accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]))
    fabric.launch()
    model = make_model(args.width, args.layers)  # built whole (the same weights as the single process), then
    engine = fabric.setup_module(model)  # partitioned by deepspeed.initialize
    rank = fabric.global_rank
    times: dict[str, list[float]] = {"per_token": [], "gathered": [], "inside": []}
    outputs: dict[str, list[int]] = {}
    with torch.no_grad():
        generate(engine.module, rank, 2)  # warm-up (DeepSpeed traces the module order)
        for _ in range(args.repeats):
            for variant in ("per_token", "gathered"):
                fabric.barrier()
                start = time.perf_counter()
                if variant == "gathered":
                    with lightspeed.gathered_for_generation(engine.module, enabled=True):
                        inside = time.perf_counter()
                        outputs[variant] = generate(engine.module, rank, args.tokens)
                        times["inside"].append(time.perf_counter() - inside)
                else:
                    outputs[variant] = generate(engine.module, rank, args.tokens)
                fabric.barrier()
                times[variant].append(time.perf_counter() - start)
    gathered: list[Any] = [None] * fabric.world_size
    torch.distributed.all_gather_object(gathered, {"times": times, "outputs": outputs})
    if rank == 0:
        out.write_text(json.dumps(gathered))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", type=Path)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args, args.worker)
        return
    torch.set_num_threads(1)
    print(f"load: {os.getloadavg()[0]:.1f}")
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.devices}"]
    command += ["--master_port=29741", __file__, "--worker", str(out)]
    command += ["--width", str(args.width), "--layers", str(args.layers), "--tokens", str(args.tokens)]
    command += ["--repeats", str(args.repeats)]
    subprocess.run(command, env=env, check=True, capture_output=True)
    ranks = json.loads(out.read_text())
    model = make_model(args.width, args.layers)
    single: list[float] = []
    with torch.no_grad():
        expected = [generate(model, rank, args.tokens) for rank in range(args.devices)]
        for _ in range(args.repeats):
            start = time.perf_counter()
            generate(model, args.devices - 1, args.tokens)  # the longest rank's generation
            single.append(time.perf_counter() - start)
    for rank, result in enumerate(ranks):
        for variant, tokens in result["outputs"].items():
            assert tokens == expected[rank], f"rank {rank} {variant}: tokens differ from single-process generation"
    new_tokens = args.tokens + args.devices - 1  # the longest rank's: the ranks wait for it
    speeds = {"single process": new_tokens / statistics.median(single)}
    for variant in ("per_token", "gathered", "inside"):
        speeds[f"ZeRO-3 {variant}"] = new_tokens / statistics.median(
            max(r["times"][variant][i] for r in ranks) for i in range(args.repeats)
        )
    print(f"load: {os.getloadavg()[0]:.1f}")
    print(
        f"GPT-2 {args.layers} x {args.width}, {args.devices} ranks, {new_tokens} new tokens, median of {args.repeats}"
    )
    for name, speed in speeds.items():
        print(f"{name:20s} {speed:8.1f} tokens/s  ({speed / speeds['single process']:.2f} x single process)")
    print(f"gathered once / per token: {speeds['ZeRO-3 gathered'] / speeds['ZeRO-3 per_token']:.2f}")
    print("tokens equal single-process generation: yes")


if __name__ == "__main__":
    main()
