"""Long context: what ``sequence_parallel_size=2`` saves per rank and what it costs, against the same training
without sequence parallelism (sp 1), both on 2 CPU ranks through ``ZeroFabricStrategy(stage=2)``.

    python bench/long_context.py                                  # a 2-layer Llama, 128 wide, lengths 256 ... 2048
    python bench/long_context.py --lengths 512 1024 2048 4096 --width 256

For every length, one row per rank (sp 1: each rank its own row; sp 2: the group shares one row, each rank half of
it): each rank's peak memory growth over a training step (``VmHWM`` reset through ``/proc/self/clear_refs`` just
before the step, minus ``VmRSS`` just before; glibc's ``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors leave the
resident set at once) and the bytes autograd saves for the backward pass (``saved_tensors_hooks``, each storage once,
weights not counted). The cap is sp 1's peak at its longest length: sp 2 then trains longer sequences (that length
times 1.5, 1.75, 1.8, 1.9, 2.0, ...) until one exceeds it, and the longest that stays under it is compared with sp
1's; the same again for sp 2 with ``tiled_mlp=True`` (DeepSpeed's ``TiledMLP``), and with ``tiled_logits_loss=256``
as well (the loss over chunks of 256 tokens, ``--logits-chunk``: the ``[tokens, vocabulary]`` logits never whole;
``True``'s default of about 1 GiB per chunk would be one chunk at this vocabulary). Throughput at
equal tokens: sp 1 trains 2 rows per step (one per rank), sp 2 trains 2 rows per step (both ranks on each), at the
longest length; tokens per second of the slowest rank, median of the timed steps.
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


def make_config(width: int, layers: int, length: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=1024,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=length,
    )


def batch(rows: int, length: int, seed: int) -> dict[str, Any]:
    import torch

    ids = torch.randint(1, 1024, (rows, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def step(fabric: Any, model: Any, optimizer: Any, data: dict[str, Any]) -> dict[str, float]:
    """One training step on ``data`` (a whole batch, sliced here under sp 2): peak growth, saved bytes, seconds."""
    import torch

    sliced = fabric.strategy._session.sequence_parallel.shard(data)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    fabric.barrier()
    reset_peak()
    before = status_bytes("VmRSS")
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(**sliced).loss
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    seconds = time.perf_counter() - start
    peak = status_bytes("VmHWM") - before
    saved = sum(nbytes for pointer, nbytes in storages.items() if pointer not in weights)
    return {"peak": peak, "saved": saved, "seconds": seconds, "loss": float(loss.detach())}


def worker(args: argparse.Namespace, out: Path) -> None:
    import lightning as L
    import torch
    from transformers import LlamaForCausalLM

    import lightspeed

    torch.set_num_threads(1)
    strategy = lightspeed.fabric.ZeroFabricStrategy(
        stage=2, sequence_parallel_size=args.sp, tiled_mlp=args.tiled_mlp, tiled_logits_loss=args.logits_chunk or False
    )
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    longest = max(args.lengths) * (max(args.stretch) if args.sp > 1 else 1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(make_config(args.width, args.layers, int(longest)))  # sdpa
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    rank = fabric.global_rank
    own = rank if args.sp == 1 else 0  # sp 1: each rank its own row; sp 2: the group's one row
    result: dict[str, Any] = {"memory": {}, "stretch": {}, "speed": []}
    step(fabric, model, optimizer, batch(1, min(args.lengths), own))  # warm-up
    for length in args.lengths:
        result["memory"][length] = step(fabric, model, optimizer, batch(1, length, own))
    if args.sp > 1:
        cap = args.cap
        for factor in args.stretch:
            length = int(max(args.lengths) * factor) // 64 * 64
            measured = step(fabric, model, optimizer, batch(1, length, own))
            result["stretch"][length] = measured
            over = torch.tensor(float(measured["peak"] > cap))
            torch.distributed.all_reduce(over)  # the worst rank decides, on every rank alike
            if over.item():
                break
    rows = 1 if args.sp == 1 else 2  # 2 rows per step either way
    for _ in range(args.repeats):
        result["speed"].append(step(fabric, model, optimizer, batch(rows, max(args.lengths), own))["seconds"])
    gathered: list[Any] = [None] * fabric.world_size
    torch.distributed.all_gather_object(gathered, result)
    if rank == 0:
        out.write_text(json.dumps(gathered))


def launch(
    args: argparse.Namespace, sp: int, cap: float, tiled_mlp: bool = False, logits_chunk: int = 0
) -> list[dict[str, Any]]:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    env["PYTHONPATH"] = str(ROOT / "src")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29743", __file__]
    command += ["--worker", str(out), "--sp", str(sp), "--cap", str(cap), "--width", str(args.width)]
    command += ["--layers", str(args.layers), "--repeats", str(args.repeats), "--lengths"]
    command += [str(length) for length in args.lengths] + ["--stretch"] + [str(f) for f in args.stretch]
    command += ["--tiled-mlp"] if tiled_mlp else []
    command += ["--logits-chunk", str(logits_chunk)]
    subprocess.run(command, env=env, check=True, capture_output=True)
    return json.loads(out.read_text())


def worst(ranks: list[dict[str, Any]], section: str, length: str, key: str) -> float:
    return max(rank[section][length][key] for rank in ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument(
        "--stretch", type=float, nargs="+", default=[1.5, 1.75, 1.8, 1.9, 2.0, 2.1, 2.25, 2.5, 3.0, 3.5, 4.0]
    )
    parser.add_argument("--tiled-mlp", action="store_true")
    parser.add_argument("--logits-chunk", type=int, default=256)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--cap", type=float, default=0.0)
    parser.add_argument("--worker", type=Path)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args, args.worker)
        return
    print(f"load: {os.getloadavg()[0]:.1f}")
    plain = launch(args, 1, 0.0)  # the launches without tiled_logits_loss pass --logits-chunk 0
    longest = str(max(args.lengths))
    cap = worst(plain, "memory", longest, "peak")
    split = launch(args, 2, cap)
    tiled = launch(args, 2, cap, tiled_mlp=True)
    both = launch(args, 2, cap, tiled_mlp=True, logits_chunk=args.logits_chunk)
    print(f"load: {os.getloadavg()[0]:.1f}")
    print(f"Llama {args.layers} x {args.width}, 8 heads, ZeRO-2, 2 CPU ranks, one row per rank (sp 1) or per group")
    print("length | sp 1 peak / rank | sp 2 peak / rank | ratio | sp 1 saved / rank | sp 2 saved / rank | ratio")
    for length in map(str, args.lengths):
        p1, p2 = worst(plain, "memory", length, "peak"), worst(split, "memory", length, "peak")
        s1, s2 = worst(plain, "memory", length, "saved"), worst(split, "memory", length, "saved")
        print(
            f"{length:>6} | {p1 / MIB:9.1f} MiB | {p2 / MIB:9.1f} MiB | {p2 / p1:.2f} | {s1 / MIB:9.1f} MiB | "
            f"{s2 / MIB:9.1f} MiB | {s2 / s1:.2f}"
        )
    print(f"cap {cap / MIB:.1f} MiB / rank: sp 1's peak at {longest} tokens")
    logits = f"sp 2 + tiled_mlp + tiled_logits_loss={args.logits_chunk}"
    for name, ranks in (("sp 2", split), ("sp 2 + tiled_mlp", tiled), (logits, both)):
        for length in ranks[0]["stretch"]:
            print(f"{name} at {length}: peak {worst(ranks, 'stretch', length, 'peak') / MIB:.1f} MiB / rank")
        fitting = [int(length) for length in ranks[0]["stretch"] if worst(ranks, "stretch", length, "peak") <= cap]
        most = max(fitting, default=int(longest))
        print(f"{name} fits {most} tokens under the cap: {most / int(longest):.2f}x sp 1's {longest}")
    times1 = statistics.median(max(rank["speed"][i] for rank in plain) for i in range(args.repeats))
    times2 = statistics.median(max(rank["speed"][i] for rank in split) for i in range(args.repeats))
    times3 = statistics.median(max(rank["speed"][i] for rank in both) for i in range(args.repeats))
    tokens = 2 * int(longest)
    print(
        f"throughput at {longest} tokens, 2 rows per step: sp 1 {tokens / times1:.0f} tokens/s, sp 2 "
        f"{tokens / times2:.0f} tokens/s: {times1 / times2:.2f}x sp 1; {logits}: {tokens / times3:.0f} tokens/s, "
        f"{times1 / times3:.2f}x sp 1"
    )


if __name__ == "__main__":
    main()
