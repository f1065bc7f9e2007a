"""The Ray Train runs of the tests: a local Ray (no dashboard), a ``TorchTrainer`` of 2 CPU workers whose checkpoints
go to OUT/storage/run, restarted once after a killed worker when asked; a stopped worker and what each rank raised."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STORAGE_NAME = "run"
#: the ``hang`` fault: the process group's timeout (Ray's ``TorchConfig(timeout_s=)``), the step rank 1 stops at
HANG_TIMEOUT_S, HANG_STEP = 10, 3


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
    """``train_func(config)`` on 2 CPU workers under a local Ray; ``config["fault"]``: ``"kill"`` allows one restart,
    ``"hang"`` sets the process group's timeout to HANG_TIMEOUT_S and writes what ``TorchTrainer.fit`` raised to
    OUT/driver_error.json. Ray's last checkpoint's path goes to OUT/ray_checkpoint.txt."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    hanging = config.get("fault") == "hang"
    ray.init(num_cpus=3, include_dashboard=False, configure_logging=False, log_to_driver=True)
    try:
        trainer = TorchTrainer(
            train_func,
            train_loop_config={**config, "out": str(out)},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            torch_config=TorchConfig(timeout_s=HANG_TIMEOUT_S if hanging else 1800),  # else Ray's default
            run_config=RunConfig(
                storage_path=str(out / "storage"),
                name=STORAGE_NAME,
                failure_config=FailureConfig(max_failures=1 if config.get("fault") == "kill" else 0),
                checkpoint_config=CheckpointConfig(num_to_keep=None),
            ),
        )
        try:
            result = trainer.fit()
        except Exception as error:
            if not hanging:
                raise
            record_error(out / "driver_error.json", error)
            return
    finally:
        ray.shutdown()
    assert result.checkpoint is not None, "Ray kept no checkpoint"
    (out / "ray_checkpoint.txt").write_text(result.checkpoint.path)


def stop_rank_one_at_hang_step(rank: int, step: int) -> None:
    """The ``hang`` fault: rank 1 stops its whole process (SIGSTOP, as a rank stuck in native code looks) at the start
    of step HANG_STEP, so that rank 0 times out in the next collective."""
    if rank == 1 and step == HANG_STEP:
        os.kill(os.getpid(), signal.SIGSTOP)


def record_error(path: Path, error: BaseException) -> None:
    """What a worker (OUT/error_rank<R>.json) or the driver (OUT/driver_error.json) raised: its type and message."""
    path.write_text(json.dumps({"type": type(error).__name__, "message": str(error)}))
