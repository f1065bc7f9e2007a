"""Driver: a Fabric loop under Ray Train (``TorchTrainer``, 2 CPU workers) with ``RayZeroFabricStrategy(stage=STAGE)``:
AdamW on ``make_net()``, the global batch of step ``s`` split over the ranks as a shuffled DistributedSampler hands it
out; every 4 steps each worker ``fabric.save``s into a directory of its own and reports it to Ray; a restarted
worker ``fabric.load``s ``ray.train.get_checkpoint()``.

usage: ray_fabric.py OUT STAGE STEPS [FAULT]

FAULT ``kill``: in the first attempt, rank 1 ends its process before step 6, once Ray registered the step-4
checkpoint; ``FailureConfig(max_failures=1)`` restarts the workers. Rank 0 of the last attempt writes the gathered
weights to OUT/weights.pt and OUT/result.json. FAULT ``hang`` (tests/_support/ray_train.py): rank 1 stops its process
before step HANG_STEP under a short process-group timeout, no restart; what each rank and the driver raised goes to
OUT/error_rank<R>.json and OUT/driver_error.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import ray
import torch
from ray.train import Checkpoint

from _support.ray_train import (
    record_error,
    run_torch_trainer,
    stop_rank_one_at_hang_step,
    wait_for_registered_checkpoint,
)

SAVE_EVERY, N, GLOBAL_BATCH = 4, 64, 8


def train_func(config: dict[str, Any]) -> None:
    import lightning as L

    from _support.models import full_state_dict, make_net
    from lightspeed.ray import RayZeroFabricStrategy

    out = Path(config["out"])
    fabric = L.Fabric(strategy=RayZeroFabricStrategy(stage=config["stage"]), accelerator="cpu")
    fabric.launch()
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    checkpoint = ray.train.get_checkpoint()
    resumed_from = None
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            fabric.load(Path(directory) / "state.ckpt", state)
        resumed_from = state["step"]
    rank = fabric.global_rank
    try:
        train_steps(config, fabric, model, optimizer, state, checkpoint is None)
    except BaseException as error:
        record_error(out / f"error_rank{rank}.json", error)
        raise
    inner = model._forward_module
    weights = full_state_dict(inner.module if hasattr(inner, "module") else inner)
    if rank == 0:
        torch.save({f"net.{key}": value for key, value in weights.items()}, out / "weights.pt")
        (out / "result.json").write_text(json.dumps({"step": state["step"], "resumed_from_step": resumed_from}))


def train_steps(config: dict[str, Any], fabric: Any, model: Any, optimizer: Any, state: dict, first: bool) -> None:
    """The loop: ``state["step"]`` up to STEPS, a reported checkpoint every SAVE_EVERY steps; the faults."""
    from torch import nn

    from _support.models import make_regression_data, rank_batches

    out = Path(config["out"])
    data = make_regression_data(N)
    world, rank = fabric.world_size, fabric.global_rank
    while state["step"] < config["steps"]:
        step = state["step"]
        if config["fault"] == "kill" and first and rank == 1 and step == SAVE_EVERY + 2:
            wait_for_registered_checkpoint(out)
            os._exit(1)
        if config["fault"] == "hang":
            stop_rank_one_at_hang_step(rank, step)
        epoch, index = divmod(step, N // GLOBAL_BATCH)
        indices = rank_batches(N, world, GLOBAL_BATCH // world, epoch)[index][rank]
        x, y = data.tensors[0][indices], data.tensors[1][indices]
        fabric.backward(nn.functional.mse_loss(model(x), y), model=model)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        if state["step"] % SAVE_EVERY == 0:
            with tempfile.TemporaryDirectory() as directory:
                fabric.save(Path(directory) / "state.ckpt", state)
                files = sorted(str(p.relative_to(directory)) for p in Path(directory).rglob("*") if p.is_file())
                with (out / f"saves_rank{rank}.jsonl").open("a") as log:
                    log.write(json.dumps({"step": state["step"], "files": files}) + "\n")
                ray.train.report({"step": state["step"]}, checkpoint=Checkpoint.from_directory(directory))


def main() -> None:
    out, stage, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    fault = sys.argv[4] if len(sys.argv) > 4 else "none"
    run_torch_trainer(train_func, {"stage": stage, "steps": steps, "fault": fault}, out)


if __name__ == "__main__":
    main()
