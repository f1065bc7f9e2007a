"""``lightspeed test``: a few real training steps with 2 processes (or all GPUs) through the Trainer with a
lightspeed strategy, then checks that the processes agree (RNG, initial and final weights). One line per check,
a final verdict, exit code 1 when something failed and the fix when the cause is a known one.

The same module is the worker: ``torchrun ... -m lightspeed.cli.test_command --worker OUT_DIR`` runs one rank
and writes what it saw to ``OUT_DIR/rank<N>.json``; the command compares those files. torchrun and its workers run
in their own process group, so a run that hangs past ``--timeout`` is killed whole (no orphaned workers).

Test hook: the environment variable ``LIGHTSPEED_TEST_INJECT_FAULT`` (:data:`TEST_HOOK_FAULT_ENV`) exists only so
lightspeed's own tests can check the failure path on a real run. Set to ``weights``, rank 1 reports final weights
that differ from the other ranks'. Leave it unset in real use.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightspeed.cli.main import EXIT_CHECK_FAILED, EXIT_OK, UsageError
from lightspeed.core.deepspeed_runtime import NVME_PATH_ENV, export_deepspeed_accelerator

TEST_HOOK_FAULT_ENV = "LIGHTSPEED_TEST_INJECT_FAULT"
"""Test hook only (see the module docstring): ``weights`` makes rank 1 report different final weights."""
SEED = 1234


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "test",
        help="run a few real multi-process steps with a strategy and check that the processes agree",
        description="Train a tiny model for a few steps with 2 processes (or all GPUs) through the Lightning Trainer "
        "with a lightspeed strategy, then check that every process ran, that the optimizer changed the weights and "
        "that all processes agree on RNG and weights. Exit code 0: ready; 1: a check failed; 2: bad arguments.",
    )
    parser.add_argument("--strategy", default="zero2", help="registered strategy name (default zero2), e.g. zero3_offload")
    parser.add_argument("--devices", type=int, help="processes: default all GPUs, or 2 CPU processes without a GPU")
    parser.add_argument("--accelerator", choices=("auto", "cpu", "gpu"), default="auto",
                        help="auto (default): GPUs when there are any, else the CPU with gloo")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    parser.add_argument("--precision", help="Trainer precision (default: 32-true on CPU, bf16-mixed or 16-mixed on GPU)")
    parser.add_argument("--nvme-path", help="directory on an NVMe drive, for NVMe strategies")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the run counts as hung (600)")
    parser.add_argument("--keep", metavar="DIR", help="keep the workers' logs and results in DIR")
    parser.add_argument("--worker", metavar="OUT_DIR", help=argparse.SUPPRESS)


# ---------------------------------------------------------------------------------------------------------------
# worker (one rank)


def _digest(tensors: list[Any]) -> str:
    sha = hashlib.sha256()
    for tensor in tensors:
        sha.update(tensor.detach().to("cpu").float().contiguous().numpy().tobytes())
    return sha.hexdigest()


def _full_weights_digest(module: Any, perturb: bool = False) -> str:
    """sha256 of every parameter in full, gathering ZeRO-3 partitions first (a collective: every rank calls it)."""
    import torch

    params = list(module.parameters())
    context = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        context = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    with context:
        tensors = [p.detach().clone() for p in params]
    if perturb:
        tensors[0] = tensors[0] + torch.finfo(torch.float32).eps * 4
    return _digest(tensors)


def _rng_draws() -> dict[str, list[float]]:
    import random

    import numpy as np
    import torch

    state = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    draws = {"torch": torch.rand(3).tolist(), "numpy": np.random.rand(3).tolist(), "python": [random.random() for _ in range(3)]}
    random.setstate(state[0]), np.random.set_state(state[1]), torch.set_rng_state(state[2])
    return draws


def run_worker(args: argparse.Namespace) -> int:
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightspeed  # noqa: F401 - registers the strategy names

    out_dir = Path(args.worker)
    rank = int(os.environ.get("RANK", "0"))
    L.seed_everything(SEED, verbose=False)
    rng_after_seed = _rng_draws()

    class Probe(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 4))
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss.detach().float()))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    model = Probe()
    initial = _digest(list(model.parameters()))
    generator = torch.Generator().manual_seed(SEED)
    data = TensorDataset(torch.randn(64, 16, generator=generator), torch.randn(64, 4, generator=generator))
    accelerator = "gpu" if args.accelerator == "gpu" else "cpu"
    trainer = L.Trainer(
        strategy=args.strategy, accelerator=accelerator, devices=args.devices, max_steps=args.steps,
        precision=args.precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
    rng_after_training = torch.get_rng_state()
    final = _full_weights_digest(model, perturb=os.environ.get(TEST_HOOK_FAULT_ENV) == "weights" and rank == 1)
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "strategy": type(trainer.strategy).__name__,
        "steps": trainer.global_step,
        "losses": model.losses,
        "initial_weights": initial,
        "final_weights": final,
        "rng_after_seed": rng_after_seed,
        "rng_after_training": hashlib.sha256(rng_after_training.numpy().tobytes()).hexdigest(),
    }
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    return EXIT_OK


# ---------------------------------------------------------------------------------------------------------------
# checks (in the launching process)


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str = ""

    def line(self) -> str:
        return f"  {'PASS' if self.passed else 'FAIL'}  {self.name}{': ' + self.detail if self.detail else ''}"


KNOWN_CAUSES: tuple[tuple[str, str], ...] = (
    (r"[Nn]inja is required|ninja: not found|No module named 'ninja'",
     "DeepSpeed compiles its CPU Adam on first use and needs ninja: `pip install ninja`."),
    (r"(c\+\+|g\+\+|gcc|x86_64-linux-gnu-g\+\+)['\"]?:? (command )?not found|unable to execute '(c\+\+|g\+\+|gcc)'"
     r"|No such file or directory: '(c\+\+|g\+\+)'|error: command '(c\+\+|g\+\+|gcc)' failed",
     "DeepSpeed's CPU Adam (optimizer offload) needs a C++ compiler: `apt-get install build-essential` (Debian/"
     "Ubuntu), or install a DeepSpeed built with DS_BUILD_CPU_ADAM=1."),
    (r"libaio|aio\.h|async_io op is not", "NVMe offload needs DeepSpeed's async_io op: `apt-get install libaio-dev`, then "
     "run again (DeepSpeed compiles it on first use)."),
    (rf"NVMe offload needs a directory|{NVME_PATH_ENV}", "pass --nvme-path DIR (a directory on an NVMe drive)."),
    (r"CUDA out of memory|OutOfMemoryError", "a GPU ran out of memory: close other jobs on it or use fewer/other GPUs."),
    (r"Address already in use|EADDRINUSE", "the rendezvous port was taken: run again."),
)


def diagnose(log: str) -> str | None:
    """The fix for a known failure found in a worker's log, or None."""
    for pattern, fix in KNOWN_CAUSES:
        if re.search(pattern, log):
            return fix
    return None


def _last_error_line(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", line):
            return line
    return lines[-1] if lines else "no output"


def compare_ranks(results: list[dict[str, Any]], world_size: int, steps: int) -> list[Check]:
    """The checks on the workers' results: all ran, trained, changed the weights and agree with each other."""
    checks: list[Check] = []
    ranks = sorted(r["rank"] for r in results)
    started = ranks == list(range(world_size)) and all(r["world_size"] == world_size for r in results)
    checks.append(Check("processes started", started, f"ranks {ranks} of {world_size}"))
    if not results:
        return checks
    ran = all(r["steps"] == steps and r["losses"] and all(math.isfinite(x) for x in r["losses"]) for r in results)
    detail = ", ".join(f"rank {r['rank']}: {r['steps']} steps, last loss {r['losses'][-1] if r['losses'] else 'none'}"
                       for r in results)
    checks.append(Check(f"trained {steps} steps with finite losses", ran, detail))
    changed = all(r["initial_weights"] != r["final_weights"] for r in results)
    checks.append(Check("optimizer changed the weights", changed))

    def agree(name: str, key: str) -> None:
        values = {r["rank"]: r[key] for r in results}
        same = len({json.dumps(v, sort_keys=True) for v in values.values()}) == 1
        if same:
            value = next(iter(values.values()))
            shown = value[:12] if isinstance(value, str) else ""
            checks.append(Check(name, True, f"sha256 {shown}" if shown else ""))
        else:
            differing = sorted(rank for rank, v in values.items() if v != values[min(values)])
            checks.append(Check(name, False, f"rank(s) {differing} differ from rank {min(values)}"))

    agree("RNG agrees across ranks after seeding (torch, numpy, python)", "rng_after_seed")
    agree("initial weights agree across ranks", "initial_weights")
    agree("RNG agrees across ranks after training", "rng_after_training")
    agree("final weights agree across ranks", "final_weights")
    return checks


# ---------------------------------------------------------------------------------------------------------------
# command


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _plan_run(args: argparse.Namespace) -> tuple[str, int, str]:
    """(accelerator, devices, precision) for this machine and these arguments."""
    import torch

    has_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    accelerator = args.accelerator if args.accelerator != "auto" else ("gpu" if has_gpu else "cpu")
    if accelerator == "gpu" and not has_gpu:
        raise UsageError("--accelerator gpu, but no CUDA GPU is visible here. Use --accelerator cpu.")
    devices = args.devices or (torch.cuda.device_count() if accelerator == "gpu" else 2)
    if devices < 1:
        raise UsageError(f"--devices must be at least 1, got {devices}.")
    if accelerator == "gpu" and devices > torch.cuda.device_count():
        raise UsageError(f"--devices {devices}, but only {torch.cuda.device_count()} GPU(s) are visible.")
    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}.")
    precision = args.precision
    if precision is None:
        precision = "32-true" if accelerator == "cpu" else ("bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed")
    return accelerator, devices, precision


def _check_strategy(name: str, nvme_path: str | None) -> dict[str, Any]:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightspeed  # noqa: F401 - registers the names

    if name not in StrategyRegistry:
        close = difflib.get_close_matches(name, list(StrategyRegistry), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UsageError(f"Unknown strategy {name!r}.{hint} `lightspeed env` lists the lightspeed strategies.")
    params = StrategyRegistry[name].get("init_params", {})
    if "nvme" in (params.get("offload_optimizer"), params.get("offload_parameters")):
        if not (nvme_path or os.environ.get(NVME_PATH_ENV)):
            raise UsageError(f"{name} offloads to NVMe: pass --nvme-path DIR (a directory on an NVMe drive) or set "
                             f"{NVME_PATH_ENV}.")
    return params


def _deepspeed_kind(accelerator: str) -> str:
    """DeepSpeed's accelerator ("cuda" or "cpu") for the Trainer accelerator of this run."""
    return "cuda" if accelerator == "gpu" else "cpu"


def _preflight(params: dict[str, Any], accelerator: str) -> list[Check]:
    """Checks that can fail before anything is launched: the DeepSpeed ops the strategy needs."""
    targets = {params.get("offload_optimizer", "none"), params.get("offload_parameters", "none")}
    needed = (["cpu_adam"] if targets & {"cpu", "nvme"} else []) + (["async_io"] if "nvme" in targets else [])
    if not needed:
        return []
    from lightspeed.cli.env_command import deepspeed_ops

    with contextlib.redirect_stdout(sys.stderr):
        ops = deepspeed_ops(_deepspeed_kind(accelerator))
    checks = []
    for op in needed:
        entry = ops.get(op, {"usable": False, "why": "not available for this accelerator"})
        checks.append(Check(f"DeepSpeed {op} op usable", entry["usable"], entry["why"]))
    return checks


def run_process_group(command: list[str], env: dict[str, str], timeout: float, grace: float = 10.0) -> subprocess.CompletedProcess:
    """Run ``command`` in a new process group and capture its output; past ``timeout`` seconds (or on Ctrl-C) the
    whole group gets SIGTERM, then SIGKILL after ``grace`` seconds, so torchrun's workers die with it.

    ``subprocess.run(timeout=...)`` would kill only torchrun and leave its workers running (holding the port, the
    GPUs and memory). A timeout returns exit code 124 with the reason appended to stderr.
    """
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        _signal_group(proc.pid, signal.SIGKILL)  # whatever outlived the leader (a worker ignoring SIGTERM)
        return subprocess.CompletedProcess(command, 124, out, (err or "") + f"\nTimed out after {timeout:.0f} s")
    except BaseException:  # Ctrl-C (KeyboardInterrupt) or any other error: never leave the workers behind
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # the group is gone already


def _clear_stale_results(work: Path) -> None:
    """Remove results and logs of an earlier run in ``work`` (``--keep DIR`` reused), so they cannot be read as
    this run's when it fails before writing its own."""
    for path in work.glob("rank*.json"):
        path.unlink()
    shutil.rmtree(work / "logs", ignore_errors=True)


def _launch(args: argparse.Namespace, accelerator: str, devices: int, precision: str, work: Path) -> subprocess.CompletedProcess:
    export_deepspeed_accelerator(_deepspeed_kind(accelerator))  # inherited by torchrun and every rank
    env = dict(os.environ)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    if args.nvme_path:
        env[NVME_PATH_ENV] = args.nvme_path
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={devices}", "--nnodes=1",
        "--master_addr=127.0.0.1", f"--master_port={_free_port()}", "--log_dir", str(work / "logs"), "--redirects", "3",
        "-m", "lightspeed.cli.test_command", "--worker", str(work), "--strategy", args.strategy,
        "--accelerator", accelerator, "--devices", str(devices), "--steps", str(args.steps), "--precision", precision,
    ]
    return run_process_group(command, env, args.timeout)


def _worker_logs(work: Path) -> str:
    texts = [path.read_text(errors="replace") for path in sorted((work / "logs").rglob("*.log"))]
    return "\n".join(texts)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return run_worker(args)
    accelerator, devices, precision = _plan_run(args)
    params = _check_strategy(args.strategy, args.nvme_path)
    kind = f"{devices} GPU(s)" if accelerator == "gpu" else f"{devices} CPU processes (gloo)"
    print(f"lightspeed test: {args.strategy} on {kind}, {args.steps} steps, precision {precision}", flush=True)

    checks = _preflight(params, accelerator)
    if all(check.passed for check in checks):
        work_context = contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="lightspeed-test-")
        with work_context as work_dir:
            work = Path(work_dir)
            work.mkdir(parents=True, exist_ok=True)
            _clear_stale_results(work)
            proc = _launch(args, accelerator, devices, precision, work)
            results = [json.loads(path.read_text()) for path in sorted(work.glob("rank*.json"))]
            log = "\n".join((proc.stdout or "", proc.stderr or "", _worker_logs(work)))
        if proc.returncode != 0:
            fix = diagnose(log)
            detail = f"exit code {proc.returncode}: {_last_error_line(log)}"
            checks.append(Check("the run finished", False, detail + (f"\n        fix: {fix}" if fix else "")))
        checks.extend(compare_ranks(results, devices, args.steps))

    for check in checks:
        print(check.line())
    failed = [check for check in checks if not check.passed]
    if failed:
        print(f"NOT READY: {len(failed)} check(s) failed for {args.strategy}.")
        return EXIT_CHECK_FAILED
    print(f"READY: {args.strategy} trains on this machine with {devices} processes and they agree.")
    return EXIT_OK


if __name__ == "__main__":
    worker_parser = argparse.ArgumentParser(prog="python -m lightspeed.cli.test_command")
    sub = worker_parser.add_subparsers()
    add_parser(sub)
    sys.exit(run(worker_parser.parse_args(["test", *sys.argv[1:]])))
