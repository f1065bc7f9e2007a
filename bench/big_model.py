"""Bigger than the machine: fine-tune a Llama-style model whose fp32 training state (16 bytes a parameter with AdamW)
exceeds the host memory, with ``strategy="zero3_nvme"`` on 2 CPU ranks, and compare it with its two limits.

1. Writes the model as sharded safetensors with random weights (``tests/_support/big_model.py``; nothing downloaded)
   unless ``OUT/pretrained`` holds it already.
2. Measures the disk's bandwidth at the NVMe path with direct I/O (1 GiB written and read back, ``O_DIRECT``).
3. Fine-tunes it (``tests/strategies/scripts/zero_nvme_big.py``: ``from_pretrained`` in ``configure_model`` straight
   into partitions, AdamW, ``--steps`` steps, ``ZeroExport``), sampling the memory of all the job's processes
   together (torchrun and the ranks; proportional set sizes, so that the libraries they share count once) every
   0.2 s; each rank records its peak resident size, its step times and the bytes it read and wrote per step.
4. Baseline for compute: the same steps of a smaller model (``--small-*``) trained with everything in RAM
   (``zero3``), scaled by the ratio of the two models' FLOPs per token (the same tokens in both; the input embedding
   is a lookup and costs none). The scaling by parameters (the embedding counted) is printed too.

Prints peak memory of all processes together / training state (target <= 0.4) and step time / max(scaled compute
time, I/O time at the measured bandwidth) (target <= 1.5).

    python bench/big_model.py                                          # 2.1B parameters, 33.6 GB of training state
    python bench/big_model.py --hidden 1024 --layers 19 --vocab 8192   # 261M: the memory-cap test's model
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from _support.big_model import BigModelShape  # noqa: E402
from _support.launch import child_env, free_port  # noqa: E402

WORKER = REPO / "tests" / "strategies" / "scripts" / "zero_nvme_big.py"
GB = 1e9


def disk_bandwidth(folder: Path, size: int = 2**30, chunk: int = 64 * 2**20) -> tuple[float, float]:
    """Write then read ``size`` bytes in ``folder`` with ``O_DIRECT`` (no page cache): bytes per second each way."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bandwidth.probe"
    buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(chunk))
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT)
    started = time.perf_counter()
    for _ in range(size // chunk):
        os.write(fd, buffer)
    os.fsync(fd)
    os.close(fd)
    write = size / (time.perf_counter() - started)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    started = time.perf_counter()
    while os.readv(fd, [buffer]):
        pass
    read = size / (time.perf_counter() - started)
    os.close(fd)
    path.unlink()
    return write, read


def run_job(out: Path, strategy: str, steps: int, shape: BigModelShape, config: str | None) -> tuple[list[dict], int]:
    """Run the worker on 2 ranks; each rank's record and the peak memory of all the job's processes together."""
    for leftover in ("export", "nvme"):
        shutil.rmtree(out / leftover, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    cmd += [str(WORKER), str(out), strategy, str(steps), *shape.as_args(), *(["--config", config] if config else [])]
    job = subprocess.Popen(cmd, env=child_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak, peak_at, peak_parts = 0, 0.0, [0]

    def sample() -> None:
        nonlocal peak, peak_at, peak_parts
        root = psutil.Process(job.pid)
        while job.poll() is None:
            try:
                parts = [p.memory_full_info().pss for p in [root, *root.children(recursive=True)]]
                if sum(parts) > peak:
                    peak, peak_at, peak_parts = sum(parts), time.time(), parts
            except psutil.Error:
                pass
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output, _ = job.communicate()
    sampler.join()
    if job.returncode != 0:
        raise SystemExit(f"{strategy} run failed ({job.returncode}):\n{output[-5000:]}")
    records = [json.loads((out / f"memory_{rank}.json").read_text()) for rank in (0, 1)]
    first = records[0]
    phase = "loading" if peak_at < first["built_at"] else "set-up" if peak_at < first["steps_from"] else "steps"
    phase = "export" if peak_at > first["steps_to"] else phase
    parts = ", ".join(f"{part / GB:.2f}" for part in peak_parts)
    print(f"{strategy}: all processes peaked at {peak / GB:.2f} GB in the {phase} (per process: {parts} GB)")
    return records, peak


def write_model(folder: Path, shape: BigModelShape) -> None:
    if (folder / "config.json").exists():
        return
    code = "import sys; from pathlib import Path; from _support.big_model import BigModelShape, write_pretrained; "
    code += f"write_pretrained(Path({str(folder)!r}), BigModelShape({shape.hidden}, {shape.layers}, {shape.vocab}))"
    subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=REPO, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--small-hidden", type=int, default=1024)
    parser.add_argument("--small-layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("out/big_model"))
    parser.add_argument("--config", help="DeepSpeed config (JSON) merged over zero3_nvme's, e.g. swap options")
    args = parser.parse_args()
    shape = BigModelShape(args.hidden, args.layers, args.vocab)
    small = BigModelShape(args.small_hidden, args.small_layers, args.vocab)
    params, small_params = shape.parameters(), small.parameters()
    state = 16 * params

    write_model(args.out / "big" / "pretrained", shape)
    write_model(args.out / "small" / "pretrained", small)
    write_bw, read_bw = disk_bandwidth(args.out / "big" / "nvme")
    ranks, job_peak = run_job(args.out / "big", "zero3_nvme", args.steps, shape, args.config)
    small_ranks, _ = run_job(args.out / "small", "zero3", args.steps, small, None)

    later = slice(1, None) if args.steps > 1 else slice(None)  # the first step also warms up
    step = max(sum(r["step_seconds"][later]) / len(r["step_seconds"][later]) for r in ranks)
    small_step = max(sum(r["step_seconds"][later]) / len(r["step_seconds"][later]) for r in small_ranks)
    compute = small_step * shape.flops_per_token() / small.flops_per_token()
    by_parameters = small_step * params / small_params
    read = sum(sum(io[0] for io in r["step_io"][later]) / len(r["step_io"][later]) for r in ranks)
    written = sum(sum(io[1] for io in r["step_io"][later]) / len(r["step_io"][later]) for r in ranks)
    io_time = read / read_bw + written / write_bw
    limit = max(compute, io_time)
    print(f"model: {params / 1e9:.2f}B parameters, fp32 training state with AdamW {state / GB:.1f} GB; host memory")
    print(f"  {psutil.virtual_memory().total / GB:.1f} GB; 2 CPU ranks, zero3_nvme, {args.steps} steps")
    print(f"disk at the NVMe path (O_DIRECT): write {write_bw / GB:.2f} GB/s, read {read_bw / GB:.2f} GB/s")
    for rank, record in enumerate(ranks):
        print(
            f"rank {rank}: peak RSS {max(record['built_peak'], record['steps_peak']) / GB:.2f} GB (built "
            f"{record['built_peak'] / GB:.2f}, steps {record['steps_peak'] / GB:.2f}, with the export "
            f"{record['end_peak'] / GB:.2f}); steps {', '.join(f'{s:.1f}' for s in record['step_seconds'])} s, "
            f"their forward and backward {', '.join(f'{s:.1f}' for s in record['backward_seconds'])} s"
        )
    print(f"all processes together (sampled): peak {job_peak / GB:.2f} GB = {job_peak / state:.3f} x training state")
    print(f"per step (both ranks): read {read / GB:.2f} GB, written {written / GB:.2f} GB -> {io_time:.1f} s of I/O")
    print(
        f"compute baseline: zero3 in RAM, {small_params / 1e6:.0f}M parameters, {small_step:.2f} s a step x "
        f"{shape.flops_per_token() / small.flops_per_token():.2f} (FLOPs) = {compute:.1f} s"
    )
    print(f"step time {step:.1f} s / max(compute {compute:.1f} s, I/O {io_time:.1f} s) = {step / limit:.2f}")
    print(
        f"  scaled by parameters instead (x {params / small_params:.2f}, the embedding counted): "
        f"{step:.1f} s / max({by_parameters:.1f} s, {io_time:.1f} s) = {step / max(by_parameters, io_time):.2f}"
    )


if __name__ == "__main__":
    main()
