"""Worker for the reliability cases under Lightning Fabric: a hand-written loop that saves with ``fabric.save`` every
3 steps and, at start, resumes from ``lightspeed.fabric.last_checkpoint`` (run under torchrun).

usage: fabric_loop.py MODE OUT ARGS...

* ``elastic OUT STRATEGY FAULTS``: 24 steps (3 epochs of 8, 64 samples, batch 4 on 2 ranks). FAULTS as in
  elastic_fit.py: ``attempt:fault`` with ``step`` (rank 1 SIGKILLed before step 14) or ``save`` (rank 1 dies after
  writing its shard of the step-15 checkpoint, before the commit). The finishing attempt trains the same model
  uninterrupted in the same processes; rank 0 writes both weights to OUT/weights.pt and appends where each attempt
  started to OUT/attempts.jsonl.
* ``hang OUT STRATEGY TIMEOUT_S [HOW]``: rank 1 stops itself (SIGSTOP) before step 3, or with HOW ``exits`` fails
  there (an exception ends its process) and rank 0 gets SIGTERM while it names the failure; rank 0 writes its error
  to OUT/rank0_error.txt.
* ``reshard OUT GLOBAL_BATCH ACTION...`` (``write:NAME``/``resume:NAME``, as reshard.py): ZeRO 1, 2, 3; 3 steps,
  ``fabric.save``, continued to step 7 (OUT/NAME/CONFIG/reference.pt), or a checkpoint written by another number of
  processes continued to step 7 (OUT/NAME/CONFIG/resumed_<WORLD_SIZE>.pt).
* ``bad_input OUT``: ZeRO-2; a checkpoint whose shard was truncated, and the checkpoint of another model, each loaded
  before any step, the checkpoint's tag folder given instead of the checkpoint, and ``Fabric(num_nodes=2)`` under a
  one-node torchrun; every rank writes the errors and the steps taken to OUT/facts_rank<R>.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

import lightspeed
from _support.models import IN_FEATURES, OUT_FEATURES, full_state_dict, make_net, make_regression_data, rank_batches
from _support.outcomes import error_text
from lightspeed.core.reliability import process_group

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
SAVE_EVERY = 3


def make_fabric(strategy: Any) -> L.Fabric:
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]))
    fabric.launch()
    return fabric


def engine_module(model: Any) -> nn.Module:
    inner = model._forward_module
    return inner.module if hasattr(inner, "module") else inner


class Loop:
    """The user's loop: AdamW on ``make_net()``, the global batch of step ``s`` split over the ranks exactly as a
    shuffled DistributedSampler (seed 0) hands it out, whatever the number of processes."""

    def __init__(self, fabric: L.Fabric, net: nn.Module | None = None, n: int = 64, global_batch: int = 8) -> None:
        self.fabric, self.n, self.global_batch = fabric, n, global_batch
        model = net if net is not None else make_net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        self.model, self.optimizer = fabric.setup(model, optimizer)
        self.state: dict[str, Any] = {"model": self.model, "optimizer": self.optimizer, "step": 0}
        self.data = make_regression_data(n)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        per_epoch = self.n // self.global_batch
        epoch, index = divmod(step, per_epoch)
        world = self.fabric.world_size
        indices = rank_batches(self.n, world, self.global_batch // world, epoch)[index][self.fabric.global_rank]
        return self.data.tensors[0][indices], self.data.tensors[1][indices]

    def step(self) -> None:
        x, y = self.batch(self.state["step"])
        self.fabric.backward(nn.functional.mse_loss(self.model(x), y), model=self.model)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.state["step"] += 1

    def weights(self) -> dict[str, torch.Tensor]:
        return full_state_dict(engine_module(self.model))


# ----------------------------------------------------------------------------------------------------------- elastic
def elastic(out: Path, strategy: str, faults: str) -> None:
    plan = dict(item.split(":") for item in faults.split(",") if item)
    fault = plan.get(str(ATTEMPT))
    fabric = make_fabric(strategy)
    steps = 24
    ckpts = out / "ckpts"
    loop = Loop(fabric)
    last = lightspeed.fabric.last_checkpoint(fabric, ckpts)
    if last is not None:
        fabric.load(last, loop.state)
    if fabric.global_rank == 0:
        found = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
        record = {"attempt": ATTEMPT, "step": loop.state["step"], "checkpoints": found}
        with (out / "attempts.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
    if fault == "save" and fabric.global_rank == 1:
        engine = loop.model._forward_module
        original = engine.save_checkpoint

        def dying_save(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if loop.state["step"] == 15:
                os._exit(17)  # shard written, checkpoint not committed
            return result

        engine.save_checkpoint = dying_save
    while loop.state["step"] < steps:
        if fault == "step" and fabric.global_rank == 1 and loop.state["step"] == 14:
            os.kill(os.getpid(), signal.SIGKILL)
        loop.step()
        if loop.state["step"] % SAVE_EVERY == 0:
            fabric.save(ckpts / f"step={loop.state['step']}.ckpt", loop.state)
    resumed, finished = loop.weights(), loop.state["step"]

    reference = Loop(fabric)
    while reference.state["step"] < steps:
        reference.step()
    expected = reference.weights()
    if fabric.global_rank == 0:
        torch.save({"elastic": resumed, "reference": expected, "steps": finished}, out / "weights.pt")


# -------------------------------------------------------------------------------------------------------------- hang
def hang(out: Path, name: str, timeout_s: float, how: str) -> None:
    timeout = timedelta(seconds=timeout_s)
    if name == "ddp_exact":
        strategy: Any = lightspeed.fabric.DDPExactFabricStrategy(timeout=timeout)
    else:
        strategy = lightspeed.fabric.ZeroFabricStrategy(stage=2, timeout=timeout)
    fabric = make_fabric(strategy)
    loop = Loop(fabric)
    if how == "exits" and fabric.global_rank == 0:
        sigterm_while_naming_the_failure()
    try:
        while loop.state["step"] < 8:
            if fabric.global_rank == 1 and loop.state["step"] == 3:
                if how == "exits":
                    raise RuntimeError("rank 1 fails on purpose")
                (out / "stopped_pid.txt").write_text(str(os.getpid()))  # the test kills it once rank 0 failed
                os.kill(os.getpid(), signal.SIGSTOP)
            loop.step()
    except BaseException as err:
        if fabric.global_rank == 0:
            (out / "rank0_error.txt").write_text(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        raise
    (out / f"finished{fabric.global_rank}.txt").write_text("no error")


def sigterm_while_naming_the_failure() -> None:
    """torchrun's SIGTERM, sent once rank 1 ended, at the worst moment: after the collective failed, before lightspeed
    names the failure."""
    explain = process_group.explain_timeout

    def explain_after_sigterm(error: BaseException) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        return explain(error)

    process_group.explain_timeout = explain_after_sigterm


# ----------------------------------------------------------------------------------------------------------- reshard
RESHARD_CONFIGS = ["s1", "s2", "s3"]
FIRST_STEPS, LAST_STEP = 3, 7


def continue_from(ckpt: Path, config: str, global_batch: int) -> dict[str, torch.Tensor]:
    fabric = make_fabric(lightspeed.fabric.ZeroFabricStrategy(stage=int(config[1])))
    loop = Loop(fabric, n=48, global_batch=global_batch)
    fabric.load(ckpt, loop.state)
    assert loop.state["step"] == FIRST_STEPS, loop.state["step"]
    while loop.state["step"] < LAST_STEP:
        loop.step()
    return loop.weights()


def reshard(out: Path, global_batch: int, actions: list[str]) -> None:
    for action in actions:
        mode, name = action.split(":")
        for config in RESHARD_CONFIGS:
            folder = out / name / config
            folder.mkdir(parents=True, exist_ok=True)
            ckpt = folder / "ckpt"
            if mode == "write":
                fabric = make_fabric(lightspeed.fabric.ZeroFabricStrategy(stage=int(config[1])))
                first = Loop(fabric, n=48, global_batch=global_batch)
                while first.state["step"] < FIRST_STEPS:
                    first.step()
                fabric.save(ckpt, first.state)
                weights, result = continue_from(ckpt, config, global_batch), "reference.pt"
            else:
                weights = continue_from(ckpt, config, global_batch)
                result = f"resumed_{torch.distributed.get_world_size()}.pt"
            if torch.distributed.get_rank() == 0:
                torch.save(weights, folder / result)


# --------------------------------------------------------------------------------------------------------- bad input
def bad_input(out: Path) -> None:
    facts: dict[str, Any] = {}
    fabric = make_fabric("zero2")
    loop = Loop(fabric)
    loop.step()
    good = out / "good.ckpt"
    fabric.save(good, loop.state)
    truncated = out / "truncated.ckpt"
    fabric.save(truncated, loop.state)
    if fabric.global_rank == 0:
        shard = truncated / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        with shard.open("r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    fabric.barrier()

    fresh = Loop(fabric)
    facts["truncated"] = error_text(lambda: fabric.load(truncated, fresh.state))
    facts["truncated_step"] = fresh.state["step"]
    facts["tag_folder"] = error_text(lambda: fabric.load(good / "checkpoint", fresh.state))

    wider = nn.Sequential(nn.Linear(IN_FEATURES, 41), nn.Tanh(), nn.Linear(41, OUT_FEATURES))
    other = Loop(fabric, net=wider)
    facts["other_model"] = error_text(lambda: fabric.load(good, other.state))
    facts["other_model_step"] = other.state["step"]
    facts["num_nodes"] = error_text(lambda: L.Fabric(strategy="zero2", accelerator="cpu", devices=2, num_nodes=2))
    (out / f"facts_rank{fabric.global_rank}.json").write_text(json.dumps(facts, indent=1))


if __name__ == "__main__":
    mode, target = sys.argv[1], Path(sys.argv[2])
    if mode == "elastic":
        elastic(target, sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else "")
    elif mode == "hang":
        hang(target, sys.argv[3], float(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else "stops")
    elif mode == "reshard":
        reshard(target, int(sys.argv[3]), sys.argv[4:])
    elif mode == "bad_input":
        bad_input(target)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
