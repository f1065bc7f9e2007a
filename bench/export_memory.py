"""Peak memory and wall time of exporting a ZeRO-3 checkpoint: lightspeed vs DeepSpeed's zero_to_fp32 vs Lightning.

1. Builds a real ZeRO-3 checkpoint of a ``--params``-parameter model (default 500M: fp32 weights 2 GB, Adam states
   4 GB more) on 2 CPU ranks (torchrun, gloo, ``deepspeed.zero.Init``), one optimizer step.
2. Exports it with each converter in its own fresh process (so import costs are equal and peaks do not mix):
   * lightspeed: ``lightspeed.export.export_checkpoint(..., max_shard_size=--shard-size)``
   * deepspeed: ``zero_to_fp32.py`` logic with ``--safe_serialization`` (``convert_zero_checkpoint_to_state_dict``)
   * lightning: ``lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict`` (one file)
3. Prints wall time of the export call, the process's peak RSS (``ru_maxrss``, includes memory-mapped pages it
   touched) and the RSS after imports, as ratios to the fp32 model size and to DeepSpeed's converter; then checks
   that lightspeed's export equals DeepSpeed's tensor by tensor.

Targets (issue 3): lightspeed peak RSS <= 0.35 x fp32 model size with 1 GB shards; wall time <= DeepSpeed's.

    python bench/export_memory.py                    # 500M parameters (about 8 GB of checkpoint on disk)
    python bench/export_memory.py --params 50e6      # quick run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WIDTH, VOCAB = 1024, 32000


def layer_count(params: float) -> int:
    per_block = 2 * (WIDTH * 4 * WIDTH) + 4 * WIDTH + WIDTH
    return max(1, math.ceil((params - VOCAB * WIDTH) / per_block))


def build_model(layers: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(WIDTH, 4 * WIDTH)
            self.down = nn.Linear(4 * WIDTH, WIDTH)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return x.float().pow(2).mean()

    return Model()


def make_checkpoint(out: Path, layers: int) -> None:
    """Runs on every rank under torchrun: one ZeRO-3 step, then save."""
    import deepspeed
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    deepspeed.init_distributed("gloo")
    config = {
        "train_micro_batch_size_per_gpu": 1,
        # small buckets and sub-groups keep the two ranks' temporaries small enough for a 24 GiB machine
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 2e7,
            "reduce_bucket_size": 5e7,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_max_live_parameters": 1e8,
            "stage3_max_reuse_distance": 1e8,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = build_model(layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    loss = engine(torch.randint(0, VOCAB, (1, 8)))
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(str(out), tag="bench")
    dist.barrier()
    dist.destroy_process_group()


def run_exporter(name: str, ckpt: Path, out: Path, shard_size: str) -> None:
    """Runs in its own process; prints one JSON line with wall time and peak RSS."""
    import torch  # noqa: F401  - import costs are the same for every exporter and measured separately

    if name == "lightspeed":
        from lightspeed.export import export_checkpoint
    elif name == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict
    else:
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict
    imported_rss = _rss_now()
    start = time.perf_counter()
    if name == "lightspeed":
        export_checkpoint(ckpt, out, max_shard_size=shard_size)
    elif name == "deepspeed":
        convert_zero_checkpoint_to_state_dict(str(ckpt), str(out), max_shard_size=shard_size, safe_serialization=True)
    else:
        out.mkdir(parents=True)
        convert_zero_checkpoint_to_fp32_state_dict(str(ckpt), str(out / "lightning_model.pt"))
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"wall_s": wall, "peak_rss": peak, "imported_rss": imported_rss}))


def _rss_now() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def measure(name: str, ckpt: Path, out: Path, shard_size: str) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--run-exporter",
        name,
        "--checkpoint",
        str(ckpt),
        "--out",
        str(out),
        "--shard-size",
        shard_size,
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    total = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name} exporter failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = total
    return result


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH", "")) if p)
    return env


def same_tensors(ours: Path, theirs: Path) -> bool:
    """Compare two safetensors exports one tensor at a time (lightspeed writes tied keys once)."""
    import torch
    from safetensors import safe_open

    def files(path: Path) -> dict[str, Path]:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            return {k: path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
            return {k: path / "model.safetensors" for k in handle.keys()}

    a, b = files(ours), files(theirs)
    if set(a) != set(b):
        return False
    for key in a:
        with safe_open(str(a[key]), framework="pt") as x, safe_open(str(b[key]), framework="pt") as y:
            if not torch.equal(x.get_tensor(key), y.get_tensor(key)):
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=500e6, help="model size in parameters (default 500e6)")
    parser.add_argument("--shard-size", default="1GB", help="lightspeed/DeepSpeed shard size (default 1GB)")
    parser.add_argument("--workdir", type=Path, default=None, help="where to put the checkpoint (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and exports")
    parser.add_argument("--exporters", default="lightspeed,deepspeed,lightning")
    parser.add_argument("--run-exporter", help=argparse.SUPPRESS)
    parser.add_argument("--make-checkpoint", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_exporter:
        run_exporter(args.run_exporter, args.checkpoint, args.out, args.shard_size)
        return
    if args.make_checkpoint:
        make_checkpoint(args.out, args.layers)
        return

    layers = layer_count(args.params)
    params = VOCAB * WIDTH + layers * (2 * WIDTH * 4 * WIDTH + 5 * WIDTH)
    fp32_bytes = params * 4
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lightspeed-export-bench-"))
    ckpt = workdir / "checkpoint"
    print(
        f"model: {params / 1e6:.1f}M parameters ({layers} blocks of width {WIDTH}), fp32 size {fp32_bytes / 1e9:.2f} GB"
    )
    try:
        if not (ckpt / "latest").is_file():
            start = time.perf_counter()
            workdir.mkdir(parents=True, exist_ok=True)
            log = workdir / "make_checkpoint.log"
            with open(log, "w") as handle:
                proc = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--nproc_per_node=2",
                        "--master_port=29517",
                        __file__,
                        "--make-checkpoint",
                        "--layers",
                        str(layers),
                        "--out",
                        str(ckpt),
                    ],
                    env=_env(),
                    stdout=handle,
                    stderr=subprocess.STDOUT,
                )
            if proc.returncode != 0:
                raise SystemExit(f"building the checkpoint failed; last lines of {log}:\n" + log.read_text()[-4000:])
            size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
            print(
                f"checkpoint: ZeRO-3, 2 ranks, {size / 1e9:.2f} GB on disk, "
                f"built in {time.perf_counter() - start:.0f} s"
            )
        results = {}
        for name in args.exporters.split(","):
            out = workdir / f"export_{name}"
            shutil.rmtree(out, ignore_errors=True)
            results[name] = measure(name, ckpt, out, args.shard_size)
        base = results.get("deepspeed")
        print(
            f"\n{'exporter':<11} {'wall s':>7} {'peak RSS GB':>12} {'x fp32 size':>12} {'RSS after imports GB':>21} "
            f"{'peak vs deepspeed':>18} {'wall vs deepspeed':>18}"
        )
        for name, r in results.items():
            vs_peak = f"{r['peak_rss'] / base['peak_rss']:.2f}x" if base else "-"
            vs_wall = f"{r['wall_s'] / base['wall_s']:.2f}x" if base else "-"
            print(
                f"{name:<11} {r['wall_s']:>7.1f} {r['peak_rss'] / 1e9:>12.2f} {r['peak_rss'] / fp32_bytes:>12.2f} "
                f"{r['imported_rss'] / 1e9:>21.2f} {vs_peak:>18} {vs_wall:>18}"
            )
        if "lightspeed" in results:
            r = results["lightspeed"]
            print(
                f"\ntarget peak RSS <= 0.35x fp32 size: {r['peak_rss'] / fp32_bytes:.2f}x "
                f"({'met' if r['peak_rss'] <= 0.35 * fp32_bytes else 'NOT met'})"
            )
            if base:
                print(
                    f"target wall <= DeepSpeed's: {r['wall_s']:.1f} s vs {base['wall_s']:.1f} s "
                    f"({'met' if r['wall_s'] <= base['wall_s'] else 'NOT met'})"
                )
                equal = same_tensors(workdir / "export_lightspeed", workdir / "export_deepspeed")
                print(f"lightspeed export equals DeepSpeed's tensor by tensor: {equal}")
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
