"""``lightspeed test``: a few real training steps with 2 processes (or all GPUs) through the Trainer with a
lightspeed strategy, then checks that the processes agree (RNG, initial and final weights). One line per check,
a final verdict, exit code 1 when something failed and the fix when the cause is a known one.

The command plans the run, launches :mod:`~lightspeed.cli.selftest.worker` under torchrun through
:mod:`~lightspeed.cli.selftest.runner` and judges the workers' results with :mod:`~lightspeed.cli.selftest.checks`.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from lightspeed.cli.selftest.checks import Check, compare_ranks, diagnose, last_error_line
from lightspeed.cli.selftest.runner import free_port, run_process_group
from lightspeed.cli.usage import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    PRECISIONS_TEXT,
    Command,
    UsageError,
    add_accelerator_argument,
    require_nvme_path,
)
from lightspeed.core.zero.config import NVME_PATH_ENV, ZERO_PRESETS, build_zero_config
from lightspeed.core.zero.runtime import export_deepspeed_accelerator


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``lightspeed test``."""
    parser.add_argument(
        "--strategy", default="zero2", help="registered strategy name (default zero2), e.g. zero3_offload"
    )
    parser.add_argument("--devices", type=int, help="processes: default all GPUs, or 2 CPU processes without a GPU")
    add_accelerator_argument(parser, "auto (default): the GPUs when there are any, else the CPU with gloo")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    parser.add_argument(
        "--precision",
        help=f"Lightning precision: {PRECISIONS_TEXT} (default: 32-true on the CPU; on GPUs the mixed precision "
        "GPU runs train in, bf16-mixed where the GPU supports bf16, else 16-mixed, so that the check covers it)",
    )
    parser.add_argument("--nvme-path", help="directory on an NVMe drive, for NVMe strategies")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the run counts as hung (600)")
    parser.add_argument("--keep", metavar="DIR", help="keep the workers' logs and results in DIR")


def _plan_run(args: argparse.Namespace) -> tuple[str, int, str]:
    """(accelerator, devices, precision) for this machine and these arguments."""
    import torch

    has_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    accelerator = args.accelerator if args.accelerator != "auto" else ("cuda" if has_gpu else "cpu")
    if accelerator == "cuda" and not has_gpu:
        raise UsageError("--accelerator cuda, but no CUDA GPU is visible here. Use --accelerator cpu.")
    devices = args.devices or (torch.cuda.device_count() if accelerator == "cuda" else 2)
    if devices < 1:
        raise UsageError(f"--devices must be at least 1, got {devices}.")
    if accelerator == "cuda" and devices > torch.cuda.device_count():
        raise UsageError(f"--devices {devices}, but only {torch.cuda.device_count()} GPU(s) are visible.")
    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}.")
    precision = args.precision
    if precision is None:
        precision = (
            "32-true" if accelerator == "cpu" else ("bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed")
        )
    return accelerator, devices, precision


def _check_strategy(name: str, nvme_path: str | None) -> dict[str, Any]:
    """The registered strategy's constructor arguments; a ZeRO preset's config is built now, so a bad NVMe
    directory fails here rather than in every worker."""
    from lightning.pytorch.strategies import StrategyRegistry

    import lightspeed  # noqa: F401 - registers the names

    if name not in StrategyRegistry:
        close = difflib.get_close_matches(name, list(StrategyRegistry), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UsageError(f"Unknown strategy {name!r}.{hint} `lightspeed env` lists the lightspeed strategies.")
    preset = ZERO_PRESETS.get(name)
    if preset is not None:
        if preset.uses_nvme:
            require_nvme_path(name, nvme_path)
        build_zero_config(preset.stage, preset.offload_optimizer, preset.offload_parameters, nvme_path=nvme_path)
    return StrategyRegistry[name].get("init_params", {})


def _preflight(params: dict[str, Any], accelerator: str) -> list[Check]:
    """Checks that can fail before anything is launched: the DeepSpeed ops the strategy needs."""
    targets = {params.get("offload_optimizer", "none"), params.get("offload_parameters", "none")}
    needed = (["cpu_adam"] if targets & {"cpu", "nvme"} else []) + (["async_io"] if "nvme" in targets else [])
    if not needed:
        return []
    from lightspeed.cli.env_command import deepspeed_ops

    with contextlib.redirect_stdout(sys.stderr):
        ops = deepspeed_ops(accelerator)  # DeepSpeed's and the Trainer's names agree: cuda, cpu
    checks = []
    for op in needed:
        entry = ops.get(op, {"usable": False, "why": "not available for this accelerator"})
        checks.append(Check(f"DeepSpeed {op} op usable", entry["usable"], entry["why"]))
    return checks


def _clear_stale_results(work: Path) -> None:
    """Remove results and logs of an earlier run in ``work`` (``--keep DIR`` reused), so they cannot be read as
    this run's when it fails before writing its own."""
    for path in work.glob("rank*.json"):
        path.unlink()
    shutil.rmtree(work / "logs", ignore_errors=True)


def _launch(
    args: argparse.Namespace, accelerator: str, devices: int, precision: str, work: Path
) -> subprocess.CompletedProcess:
    export_deepspeed_accelerator(accelerator)  # inherited by torchrun and every rank
    env = dict(os.environ)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    if args.nvme_path:
        env[NVME_PATH_ENV] = args.nvme_path
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={devices}",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "--log_dir",
        str(work / "logs"),
        "--redirects",
        "3",
        "-m",
        "lightspeed.cli.selftest.worker",
        str(work),
        "--strategy",
        args.strategy,
        "--accelerator",
        accelerator,
        "--devices",
        str(devices),
        "--steps",
        str(args.steps),
        "--precision",
        precision,
    ]
    return run_process_group(command, env, args.timeout)


def _worker_logs(work: Path) -> str:
    texts = [path.read_text(errors="replace") for path in sorted((work / "logs").rglob("*.log"))]
    return "\n".join(texts)


def run(args: argparse.Namespace) -> int:
    """Plan, check the DeepSpeed ops, launch the workers, compare their results and print the verdict."""
    accelerator, devices, precision = _plan_run(args)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout on import; stdout is for the verdict
        params = _check_strategy(args.strategy, args.nvme_path)
    kind = f"{devices} GPU(s)" if accelerator == "cuda" else f"{devices} CPU processes (gloo)"
    print(f"lightspeed test: {args.strategy} on {kind}, {args.steps} steps, precision {precision}", flush=True)

    checks = _preflight(params, accelerator)
    if all(check.passed for check in checks):
        work_context = (
            contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="lightspeed-test-")
        )
        with work_context as work_dir:
            work = Path(work_dir)
            work.mkdir(parents=True, exist_ok=True)
            _clear_stale_results(work)
            proc = _launch(args, accelerator, devices, precision, work)
            results = [json.loads(path.read_text()) for path in sorted(work.glob("rank*.json"))]
            log = "\n".join((proc.stdout or "", proc.stderr or "", _worker_logs(work)))
        if proc.returncode != 0:
            fix = diagnose(log)
            detail = f"exit code {proc.returncode}: {last_error_line(log)}"
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


COMMAND = Command(
    name="test",
    help="run a few real multi-process steps with a strategy and check that the processes agree",
    description="Train a tiny model for a few steps with 2 processes (or all GPUs) through the Lightning Trainer with "
    "a lightspeed strategy, then check that every process ran, that the optimizer changed the weights and that all "
    "processes agree on RNG and weights. Exit code 0: ready; 1: a check failed; 2: bad arguments.",
    add_arguments=add_arguments,
    run=run,
)
