"""Run real multi-process jobs from tests: each rank is its own OS process talking over gloo."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

#: what a rank prints when native code calls ``std::terminate``: on these loaded 2-core machines about once in a suite
#: run, at interpreter exit after the rank's work is done (a core dump: a gloo worker thread releasing its last
#: collective's tensors needs the GIL during ``Py_FinalizeEx``, pytorch/pytorch#190489; lightspeed's exit hook frees
#: the groups that only garbage holds, which narrows it); never a wrong result. The ranks print their Python stacks
#: with it (``PYTHONFAULTHANDLER``)
NATIVE_ABORT = "terminate called without an active exception"


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for child ranks: one intra-op thread per rank (2 cores here), no stray GPU, repo importable."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a rank killed by a signal (SIGABRT, SIGSEGV) prints every thread's Python stack
    paths = (str(REPO_ROOT / "src"), str(REPO_ROOT), str(REPO_ROOT / "tests"), env.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def srun_env(rank: int, port: int, nodes: int = 2, tasks_per_node: int = 2) -> dict[str, str]:
    """What `srun` sets for task ``rank`` of `sbatch --nodes=NODES --ntasks-per-node=TASKS_PER_NODE` (every node is
    this machine)."""
    tasks = nodes * tasks_per_node
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "lightspeed-test",
        "SLURM_NTASKS": str(tasks),
        "SLURM_NPROCS": str(tasks),
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
        "SLURM_TASKS_PER_NODE": f"{tasks_per_node}(x{nodes})",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % tasks_per_node),
        "SLURM_NODEID": str(rank // tasks_per_node),
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "SLURM_NODELIST": "127.0.0.1",
        "SLURM_CPUS_PER_TASK": "1",
        "MASTER_PORT": str(port),
    }


def run_srun_tasks(
    cmd: Sequence[str], nodes: int, tasks_per_node: int, cwd: Path = REPO_ROOT, timeout: float = 900
) -> list[str]:
    """Start ``cmd`` once per task with the environment `srun` gives it (:func:`srun_env`; every node is this
    machine), wait for all of them, and return each task's output; a task that fails fails the test with its output."""
    port = free_port()
    procs = [
        subprocess.Popen(
            list(cmd),
            env=child_env(srun_env(rank, port, nodes, tasks_per_node)),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(nodes * tasks_per_node)
    ]
    outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"task {rank} failed:\n{out[-6000:]}"
    return outputs


def _check(proc: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    if proc.returncode != 0:
        tail = (proc.stdout or "")[-6000:] + "\n--- stderr ---\n" + (proc.stderr or "")[-8000:]
        raise AssertionError(f"{what} exited with {proc.returncode}\n{tail}")
    return proc


def run_torchrun(
    script: str | Path,
    nproc: int,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float = 900,
    check: bool = True,
    retry_native_abort: bool = True,
) -> subprocess.CompletedProcess:
    """Launch ``script`` on ``nproc`` local ranks with torchrun (TorchElastic environment, gloo on CPU); see
    :func:`run_launch` for ``retry_native_abort``."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--nnodes=1",
        f"--master_port={free_port()}",
        "--master_addr=127.0.0.1",
        str(script),
        *map(str, args),
    ]
    proc = run_launch(cmd, child_env(env), timeout, retry_native_abort=retry_native_abort)
    return _check(proc, f"torchrun {Path(script).name}") if check else proc


def _abort_report(output: str) -> str:
    """The aborted rank's Python stacks (``Fatal Python error`` onwards, as ``PYTHONFAULTHANDLER`` prints them), else
    the output's end."""
    start = output.find("Fatal Python error")
    return output[start : start + 12000] if start >= 0 else output[-3000:]


def run_launch(
    cmd: Sequence[str], env: dict[str, str], timeout: float, *, retry_native_abort: bool = True
) -> subprocess.CompletedProcess:
    """Run a launch to its end; one that failed with :data:`NATIVE_ABORT` runs once more, with a warning (a second
    abort fails the test). Tests of a clean exit pass ``retry_native_abort=False``."""
    proc = subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    if retry_native_abort and proc.returncode != 0 and NATIVE_ABORT in (proc.stdout or "") + (proc.stderr or ""):
        warnings.warn(
            f"{Path(cmd[-1]).name if cmd else 'a launch'}: a rank aborted in native code ({NATIVE_ABORT!r}); running "
            f"the launch once more. Its output:\n{_abort_report(proc.stdout + proc.stderr)}",
            stacklevel=2,
        )
        proc = subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    return proc


def run_python(
    script: str | Path,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float = 900,
    check: bool = True,
    cwd: Path = REPO_ROOT,
) -> subprocess.CompletedProcess:
    """Run ``script`` as a plain process (in ``cwd``); a Trainer inside with ``devices=N`` uses Lightning's own
    launcher."""
    extra = {"MASTER_PORT": str(free_port())}
    extra.update(env or {})
    cmd = [sys.executable, str(script), *map(str, args)]
    proc = subprocess.run(cmd, env=child_env(extra), capture_output=True, text=True, timeout=timeout, cwd=cwd)
    return _check(proc, f"python {Path(script).name}") if check else proc
