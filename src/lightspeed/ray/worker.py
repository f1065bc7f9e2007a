"""What every Ray front end checks and reads: that it runs in a Ray Train worker, and where."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ray.train

__all__ = ["refuse_node_local_storage", "require_ray_worker"]


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


def refuse_node_local_storage(strategy: str, arguments: Mapping[str, Any]) -> None:
    """``node_local_storage=True`` is refused: Ray's storage collects the files every worker reports."""
    if arguments.get("node_local_storage"):
        raise ValueError(
            f"{strategy}(node_local_storage=True): not needed under Ray Train, whose storage collects the files "
            "every worker reports (each worker saves its own shard). Leave node_local_storage out."
        )
