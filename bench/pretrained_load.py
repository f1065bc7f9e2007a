"""Pretrained weights into ZeRO-3 partitions: peak host memory per rank and load time of
``lightspeed.load_pretrained`` into a model built under ``fabric.init_module()``, against the usual way without
lightspeed (every rank builds the full model, reads the full state dict, loads it, then DeepSpeed partitions it).

    python bench/pretrained_load.py                         # 2 CPU ranks, a 16 x 1024 x 1024 MLP (67 MB fp32)
    python bench/pretrained_load.py --width 2048 --depth 8 --repeats 3
    python bench/pretrained_load.py --mmap-threshold 65536   # glibc returns freed tensors to the system at once

Each variant runs in its own launch, so each process's peak resident size (VmHWM) is its own; the peak is measured
from just before the model is built. A third variant builds and sets up the partitioned model without loading
anything: its peak is the partition plus the fixed overhead (DeepSpeed's set-up, allocator slack). Prints the worst
rank's peak against the full model size and against the target bound partition + largest tensor + fixed overhead,
and the ratios lightspeed / baseline for peak memory and for time (medians over alternating repeats).
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

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _support.process_memory import reset_peak, status_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def build(width: int, depth: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def write_pretrained(path: Path, width: int, depth: int) -> None:
    """Sharded safetensors with an index, about 4 layers per shard."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    state = build(width, depth).state_dict()
    names = list(state)
    weight_map = {}
    per_shard = 8  # tensors (4 layers)
    shards = [names[i : i + per_shard] for i in range(0, len(names), per_shard)]
    for number, keys in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file({key: state[key] for key in keys}, path / file)
        weight_map.update(dict.fromkeys(keys, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def worker(variant: str, path: Path, width: int, depth: int, out: Path) -> None:
    import lightning as L

    import lightspeed

    fabric = L.Fabric(strategy="zero3", accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]))
    fabric.launch()
    fabric.barrier()
    reset_peak()
    before = status_bytes("VmRSS")
    start = time.perf_counter()
    if variant == "lightspeed":
        with fabric.init_module():
            model = build(width, depth)
        if path.name != "empty":
            lightspeed.load_pretrained(model, path)
        model = fabric.setup_module(model)
    else:
        from safetensors.torch import load_file

        model = build(width, depth)
        state: dict[str, torch.Tensor] = {}
        for file in sorted(path.glob("*.safetensors")):
            state.update(load_file(file))
        model.load_state_dict(state)
        del state
        model = fabric.setup_module(model)  # deepspeed.initialize partitions the full model
    fabric.barrier()
    seconds = time.perf_counter() - start
    peak = status_bytes("VmHWM") - before
    results: list[dict] = [{}] * fabric.world_size
    torch.distributed.all_gather_object(results, {"peak": peak, "seconds": seconds})
    if fabric.global_rank == 0:
        out.write_text(json.dumps(results))


def launch(variant: str, path: Path, args: argparse.Namespace, devices: int) -> list[dict]:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)  # both variants alike
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={devices}", "--master_port=29731"]
    command += [__file__, "--worker", variant, str(path), str(args.width), str(args.depth), str(out)]
    subprocess.run(command, env=env, check=True, capture_output=True)
    return json.loads(out.read_text())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        variant, path, width, depth, out = sys.argv[2:7]
        worker(variant, Path(path), int(width), int(depth), Path(out))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        help="glibc's MALLOC_MMAP_THRESHOLD_ for the workers (bytes); without it glibc keeps freed large blocks",
    )
    args = parser.parse_args()
    full = args.depth * (args.width * args.width + args.width) * 4
    largest = args.width * args.width * 4
    partition = full // args.devices
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pretrained"
        path.mkdir()
        write_pretrained(path, args.width, args.depth)
        empty = Path(tmp) / "empty"  # no loading: the partition and the fixed overhead
        empty.mkdir()
        runs: dict[str, list[list[dict]]] = {"lightspeed": [], "baseline": [], "overhead": []}
        print(f"load: {os.getloadavg()[0]:.1f}")
        for _ in range(args.repeats):  # alternating
            runs["lightspeed"].append(launch("lightspeed", path, args, args.devices))
            runs["baseline"].append(launch("baseline", path, args, args.devices))
            runs["overhead"].append(launch("lightspeed", empty, args, args.devices))
        print(f"load: {os.getloadavg()[0]:.1f}")

    def median(variant: str, field: str) -> float:
        return statistics.median(max(rank[field] for rank in run) for run in runs[variant])

    mib = 2**20
    overhead = median("overhead", "peak") - partition
    bound = partition + largest + overhead
    print(
        f"model {full / mib:.1f} MiB fp32, {args.devices} ranks: partition {partition / mib:.1f} MiB, largest tensor "
        f"{largest / mib:.1f} MiB, fixed overhead {overhead / mib:.1f} MiB (median of {args.repeats}, worst rank)"
    )
    for variant in ("lightspeed", "baseline"):
        peak = median(variant, "peak")
        print(
            f"{variant:10s} peak {peak / mib:7.1f} MiB per rank = {peak / full:.2f} x model, "
            f"{peak / bound:.2f} x bound; {median(variant, 'seconds'):.2f} s"
        )
    print(
        f"ratio lightspeed / baseline: peak memory {median('lightspeed', 'peak') / median('baseline', 'peak'):.2f}, "
        f"time {median('lightspeed', 'seconds') / median('baseline', 'seconds'):.2f}"
    )


if __name__ == "__main__":
    main()
