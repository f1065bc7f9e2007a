"""The Ray Train runs of the tests: a local Ray (no dashboard), a ``TorchTrainer`` of 2 CPU workers whose checkpoints
go to OUT/storage/run, restarted once after a fault when asked."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STORAGE_NAME = "run"


def run_dir(out: Path) -> Path:
    """Where Ray keeps the run's checkpoints and its checkpoint manager's snapshot."""
    return out / "storage" / STORAGE_NAME


def wait_for_registered_checkpoint(out: Path, timeout: float = 120) -> None:
    """Ray registers a reported checkpoint asynchronously: a worker that is about to fail on purpose waits until Ray
    has one (restarted before that, the workers would start from nothing)."""
    snapshot = run_dir(out) / "checkpoint_manager_snapshot.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if snapshot.is_file() and json.loads(snapshot.read_text()).get("latest_checkpoint_result"):
            return
        time.sleep(0.2)


def run_torch_trainer(train_func: Callable[[dict[str, Any]], None], config: dict[str, Any], out: Path) -> None:
    """``train_func(config)`` on 2 CPU workers under a local Ray; ``config["fault"]`` other than ``"none"`` allows one
    restart. Ray's last checkpoint's path goes to OUT/ray_checkpoint.txt."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(num_cpus=3, include_dashboard=False, configure_logging=False, log_to_driver=True)
    try:
        result = TorchTrainer(
            train_func,
            train_loop_config={**config, "out": str(out)},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(
                storage_path=str(out / "storage"),
                name=STORAGE_NAME,
                failure_config=FailureConfig(max_failures=0 if config.get("fault", "none") == "none" else 1),
                checkpoint_config=CheckpointConfig(num_to_keep=None),
            ),
        ).fit()
    finally:
        ray.shutdown()
    assert result.checkpoint is not None, "Ray kept no checkpoint"
    (out / "ray_checkpoint.txt").write_text(result.checkpoint.path)
