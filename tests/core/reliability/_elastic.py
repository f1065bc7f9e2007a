"""Launch a worker under torchrun with restarts (c10d rendezvous, as a real elastic job)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

from _support.launch import REPO_ROOT, child_env, free_port, run_launch

SCRIPTS = REPO_ROOT / "tests" / "core" / "reliability" / "scripts"


def elastic_command(script: str, nproc: int, args: Sequence[object], max_restarts: int) -> list[str]:
    """``torchrun --nproc-per-node nproc --max-restarts max_restarts`` over a c10d rendezvous on a free port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--nnodes=1",
        f"--max-restarts={max_restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--monitor-interval=0.5",
        str(SCRIPTS / script),
        *map(str, args),
    ]


def run_elastic(
    script: str, nproc: int, args: Sequence[object], max_restarts: int, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run :func:`elastic_command` to its end (once more after a native abort: :func:`run_launch`)."""
    return run_launch(elastic_command(script, nproc, args, max_restarts), child_env(), timeout)


def failure(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n{(proc.stdout or '')[-4000:]}\n--- stderr ---\n{(proc.stderr or '')[-10000:]}"
