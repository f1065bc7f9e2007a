"""What every Ray front end checks and reads: that it runs in a Ray Train worker, and where."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ray.train

__all__ = ["refuse_what_ray_decides", "require_ray_worker"]


def require_ray_worker(strategy: str) -> Any:
    """Ray Train's context of this worker; a ``RuntimeError`` saying what to do outside a training function."""
    try:
        context = ray.train.get_context()
        context.get_world_size()
    except RuntimeError as outside:
        raise RuntimeError(
            f"{strategy} runs inside a Ray Train training function: build it in the function you pass to "
            "ray.train.torch.TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=N)) and train there. "
            "Outside Ray, use lightspeed's strategies themselves (ZeroStrategy, ZeroFabricStrategy, or a strategy "
            "name such as 'zero2')."
        ) from outside
    return context


def refuse_what_ray_decides(strategy: str, arguments: Mapping[str, Any], ray_sets: tuple[str, ...] = ()) -> None:
    """A ``ValueError`` for an argument that Ray decides: ``node_local_storage=True`` (Ray's storage collects the
    files every worker reports), ``timeout`` (Ray creates the process group: its timeout is Ray's) and the names in
    ``ray_sets``."""
    if arguments.get("node_local_storage"):
        raise ValueError(
            f"{strategy}(node_local_storage=True): not needed under Ray Train, whose storage collects the files "
            "every worker reports (each worker saves its own shard). Leave node_local_storage out."
        )
    if arguments.get("timeout") is not None:
        raise ValueError(
            f"{strategy}(timeout=...): Ray Train creates the process group, so the collectives' timeout is Ray's: "
            "pass TorchTrainer(..., torch_config=ray.train.torch.TorchConfig(timeout_s=...)) and leave timeout out."
        )
    for name in ray_sets:
        if arguments.get(name) is not None:
            raise ValueError(f"{strategy}({name}=...): Ray Train sets it; leave it out.")
