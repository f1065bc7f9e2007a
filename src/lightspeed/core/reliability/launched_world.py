"""The world an external launcher started (torchrun, SLURM) against the one a front end asks for, checked before any
training, so that `num_nodes`/`devices` that disagree with the launcher are one clear error instead of a hang or a
silently smaller run. Framework-free: Lightning's cluster environments are recognised by class name, the check
itself takes integers."""

from __future__ import annotations

import os

from lightspeed.core.errors import WorldSizeMismatchError

__all__ = ["check_launched_world", "external_launcher"]


def external_launcher(environment: object) -> tuple[str | None, int]:
    """``("torchrun" | "slurm" | None, world size)`` of a Lightning cluster environment: the launcher that started the
    processes when one did (``creates_processes_externally``), else ``(None, 0)``."""
    if environment is None or not getattr(environment, "creates_processes_externally", False):
        return None, 0
    names = {cls.__name__ for cls in type(environment).__mro__}
    launcher = "torchrun" if "TorchElasticEnvironment" in names else "slurm" if "SLURMEnvironment" in names else None
    return (launcher, int(environment.world_size())) if launcher else (None, 0)  # type: ignore[attr-defined]


def check_launched_world(
    launcher: str | None, world_size: int, num_nodes: int, num_processes: int, front_end: str = "Trainer"
) -> None:
    """:class:`WorldSizeMismatchError` when ``launcher`` (``"torchrun"`` or ``"slurm"``; None: no external launcher)
    started ``world_size`` processes in another layout than ``front_end(num_nodes=..., devices=num_processes)``
    asks for. The per-node layout comes from the launcher's variables (``LOCAL_WORLD_SIZE``, ``SLURM_NNODES``,
    ``SLURM_NTASKS_PER_NODE``)."""
    asked = num_nodes * num_processes
    if launcher == "torchrun":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))
        nodes = world_size // local if local else world_size
        if asked != world_size or local != num_processes:
            raise WorldSizeMismatchError(
                f"`{front_end}(num_nodes={num_nodes}, devices={num_processes})` asks for {asked} processes, but "
                f"torchrun started {world_size} ({nodes} node(s) x {local} per node: WORLD_SIZE={world_size}, "
                f"LOCAL_WORLD_SIZE={local}). Set `{front_end}(num_nodes={nodes}, devices={local})`, or start "
                f"torchrun with `--nnodes {num_nodes} --nproc-per-node {num_processes}`."
            )
    elif launcher == "slurm":
        nnodes = os.environ.get("SLURM_NNODES") or os.environ.get("SLURM_JOB_NUM_NODES")
        per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        wrong_nodes = nnodes is not None and nnodes.isdigit() and int(nnodes) != num_nodes
        wrong_tasks = per_node.isdigit() and int(per_node) != num_processes
        if asked != world_size or wrong_nodes or wrong_tasks:
            raise WorldSizeMismatchError(
                f"`{front_end}(num_nodes={num_nodes}, devices={num_processes})` asks for {asked} processes, but SLURM "
                f"started {world_size} tasks (SLURM_NNODES={nnodes}, SLURM_NTASKS_PER_NODE={per_node or '?'}). Make "
                "`num_nodes` equal `#SBATCH --nodes` and `devices` equal `#SBATCH --ntasks-per-node`."
            )
