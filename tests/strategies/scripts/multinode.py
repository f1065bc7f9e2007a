"""Worker for the multi-node, SLURM and node-local checkpoint tests; started by torchrun (one torchrun per simulated
node, each in its own working directory) or as plain processes with the environment ``srun`` gives its tasks.

usage: multinode.py MODE SHARED NUM_NODES [RUNS TAG | STEP TIMEOUT SLEEP PHASE]
  train    - zero2_offload: 1 epoch with a checkpoint in SHARED, resume to 2 epochs; zero3 with node_local_storage:
             1 epoch with checkpoints in ./ckpt (relative: each node its own), resume to 2 epochs. Rank 0 writes the
             final weights to SHARED/weights_<nodes>x<devices>.pt.
  reference - one node: the same runs uninterrupted (zero3 with a shared checkpoint in SHARED/ckpt).
  resume   - only the node-local zero3 resume from ./ckpt/last.ckpt (the test removed a node's files first).
  slurm    - zero3_offload for 1 epoch under Lightning's SLURM environment; rank 0 writes SHARED/weights_slurm.pt.
  mismatch - a Trainer whose num_nodes disagrees with the launcher's world.
  hosts    - one torchrun per simulated host (tests/_support/hosts.py, working directory: the host's own disk): the
             runs named in RUNS (comma-separated) for 2 epochs each: a strategy name (``zero3``, ``zero2_offload``),
             or ``zero3_node_local``: 1 epoch with node-local checkpoints in ./ckpt, resumed to 2 epochs. Rank 0
             writes SHARED/weights_<TAG>.pt, every rank SHARED/<TAG>_rank<R>.json (its hostname, its host's address,
             the rendezvous address, its place); a rank whose run raises, SHARED/<TAG>_error_rank<R>.json (the
             exception's type and message) before raising it again.
  cut      - one torchrun per simulated host: zero2 with ``timeout=TIMEOUT`` seconds (default 10) for 60 steps, a
             checkpoint in SHARED/cut_ckpt every 4 steps; after step STEP (default 5) rank 0 writes SHARED/cut_now and
             every rank sleeps SLEEP seconds (default 4), so that the test cuts the link between two steps, not inside
             a collective. A rank whose fit raises writes SHARED/<PHASE>_rank<R>.json (the exception's type and
             message) before raising it again; a run that ends, rank 0 SHARED/weights_<PHASE>.pt (with the step it
             started from). PHASE (default ``cut``): ``in_save`` pauses inside the checkpoint save at step STEP
             instead (every rank has written its shard, nothing is committed), ``resume`` continues from
             SHARED/cut_ckpt/last.ckpt without the pause; ``elastic`` (under torchrun's elastic agent) fits with
             ``ckpt_path="last"`` in every attempt, and in the first one the last rank ends its process (SIGKILL)
             after step STEP.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401
from _support.models import RegressionModule, full_state_dict, make_regression_data
from _support.trainers import quiet_trainer
from lightspeed.strategies.zero import ZeroStrategy

DEVICES = 2
#: the cut mode: steps, samples, a checkpoint every CUT_SAVE_EVERY steps (the last complete one before a cut after
#: step 5 is step 4's)
CUT_STEPS, CUT_SAMPLES, CUT_SAVE_EVERY = 60, 2048, 4


def loader() -> DataLoader:
    return DataLoader(make_regression_data(), batch_size=4)


def trainer(
    strategy: object, num_nodes: int, devices: int, epochs: int, *, enable_checkpointing: bool = True, **kwargs: object
) -> L.Trainer:
    return quiet_trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        max_epochs=epochs,
        enable_checkpointing=enable_checkpointing,
        **kwargs,
    )


def fit(strategy: object, num_nodes: int, devices: int, epochs: int, ckpt_path: str | None = None, **kwargs):
    L.seed_everything(0, verbose=False)
    run = trainer(strategy, num_nodes, devices, epochs, **kwargs)
    run.fit(RegressionModule(), loader(), ckpt_path=ckpt_path)
    return run, full_state_dict(run.strategy.deepspeed_engine.module)


def node_local() -> ZeroStrategy:
    return ZeroStrategy(stage=3, node_local_storage=True)


def train(shared: Path, num_nodes: int) -> None:
    weights = {}
    z2 = shared / "z2"
    fit("zero2_offload", num_nodes, DEVICES, 1, callbacks=[ModelCheckpoint(z2, save_last=True, save_top_k=0)])
    run, weights["zero2_offload"] = fit(
        "zero2_offload", num_nodes, DEVICES, 2, ckpt_path=str(z2 / "last.ckpt"), enable_checkpointing=False
    )
    every = {"dirpath": "ckpt", "save_last": True, "save_top_k": 0, "every_n_train_steps": 4}
    fit(node_local(), num_nodes, DEVICES, 1, callbacks=[ModelCheckpoint(**every)])
    node = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")))
    if node == num_nodes - 1 and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        # a save that crashed on this node only left its staging area behind: swept, the previous checkpoint used
        stale = Path("ckpt") / "last.ckpt.lightspeed-staging"
        stale.mkdir()
        (stale / "half-written.pt").write_bytes(b"\0" * 16)
    resume(shared, num_nodes, weights, every)


def resume(shared: Path, num_nodes: int, weights: dict | None = None, every: dict | None = None) -> None:
    weights = {} if weights is None else weights
    callbacks = [ModelCheckpoint(**every)] if every else []
    run, weights["zero3_node_local"] = fit(
        node_local(),
        num_nodes,
        DEVICES,
        2,
        ckpt_path="ckpt/last.ckpt",
        callbacks=callbacks,
        enable_checkpointing=bool(every),
    )
    if run.is_global_zero:
        torch.save(weights, shared / f"weights_{num_nodes}x{DEVICES}.pt")
        (shared / "facts.json").write_text(json.dumps({"global_step": run.global_step}))


def reference(shared: Path, num_nodes: int) -> None:
    weights = {}
    _, weights["zero2_offload"] = fit("zero2_offload", 1, 4, 2, enable_checkpointing=False)
    every = {"dirpath": shared / "ckpt", "save_last": True, "save_top_k": 0, "every_n_train_steps": 4}
    run, weights["zero3"] = fit(ZeroStrategy(stage=3), 1, 4, 2, callbacks=[ModelCheckpoint(**every)])
    if run.is_global_zero:
        torch.save(weights, shared / "weights_1x4.pt")


def slurm(shared: Path, num_nodes: int) -> None:
    run, weights = fit("zero3_offload", num_nodes, 4 // num_nodes, 1, enable_checkpointing=False)
    env = type(run.strategy.cluster_environment).__name__
    if run.is_global_zero:
        torch.save({"zero3_offload": weights}, shared / "weights_slurm.pt")
    (shared / f"slurm_rank{run.global_rank}.json").write_text(
        json.dumps(
            {
                "environment": env,
                "world_size": run.world_size,
                "node_rank": run.node_rank,
                "local_rank": run.local_rank,
                "global_step": run.global_step,
            }
        )
    )


def mismatch(shared: Path, num_nodes: int) -> None:
    try:
        trainer("zero2_offload", num_nodes, DEVICES, 1)
        outcome = "no error"
    except Exception as err:  # noqa: BLE001 - the test reads the message
        outcome = f"{type(err).__name__}: {err}"
    (shared / f"mismatch_rank{os.environ.get('RANK', '0')}.txt").write_text(outcome)


def record_failure(path: Path, err: BaseException) -> None:
    """The exception a rank's fit raised, as JSON (type, message, time): the ranks of one host share one log, where
    the pieces of their tracebacks interleave, so a test reads each rank's error from here."""
    path.write_text(json.dumps({"type": type(err).__name__, "message": str(err), "time": time.time()}))


def hosts(shared: Path, num_nodes: int, runs: str = "zero3", tag: str = "hosts") -> None:
    try:
        _hosts(shared, num_nodes, runs, tag)
    except BaseException as err:
        record_failure(shared / f"{tag}_error_rank{os.environ.get('RANK', '?')}.json", err)
        raise


def _hosts(shared: Path, num_nodes: int, runs: str, tag: str) -> None:
    weights = {}
    for name in runs.split(","):
        if name == "zero3_node_local":
            every = {"dirpath": "ckpt", "save_last": True, "save_top_k": 0, "every_n_train_steps": 4}
            fit(node_local(), num_nodes, DEVICES, 1, callbacks=[ModelCheckpoint(**every)])
            run, weights[name] = fit(
                node_local(), num_nodes, DEVICES, 2, ckpt_path="ckpt/last.ckpt", enable_checkpointing=False
            )
        else:
            run, weights[name] = fit(name, num_nodes, DEVICES, 2, enable_checkpointing=False)
    if run.is_global_zero:
        torch.save(weights, shared / f"weights_{tag}.pt")
    hostname = socket.gethostname()
    facts = {
        "hostname": hostname,
        "address": socket.gethostbyname(hostname),
        "master_addr": os.environ["MASTER_ADDR"],
        "master_address": socket.gethostbyname(os.environ["MASTER_ADDR"]),
        "node_rank": run.node_rank,
        "local_rank": run.local_rank,
        "world_size": run.world_size,
        "global_step": run.global_step,
    }
    (shared / f"{tag}_rank{run.global_rank}.json").write_text(json.dumps(facts))


class _CutPause(L.Callback):
    """After step ``step``: rank 0 writes SHARED/cut_now (the test cuts the link when it appears), every rank sleeps."""

    def __init__(self, shared: Path, step: int, sleep: float) -> None:
        self.shared, self.step, self.sleep = shared, step, sleep

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            if trainer.global_rank == 0:
                (self.shared / "cut_now").write_text(str(time.time()))
            time.sleep(self.sleep)


def _pause_inside_save(shared: Path, step: int, sleep: float) -> None:
    """The save at step ``step``: once every rank's DeepSpeed save has written its files, rank 0 writes
    SHARED/cut_now and every rank sleeps, before the save's agreement and commit."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    save = DeepSpeedEngine.save_checkpoint

    def save_then_pause(engine: DeepSpeedEngine, *args: object, **kwargs: object) -> object:
        saved = save(engine, *args, **kwargs)
        if engine.global_steps == step:
            if engine.global_rank == 0:
                (shared / "cut_now").write_text(str(time.time()))
            time.sleep(sleep)
        return saved

    DeepSpeedEngine.save_checkpoint = save_then_pause  # type: ignore[method-assign]


class _KillLastRank(L.Callback):
    """In torchrun's first attempt, the last rank kills its own process after step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and trainer.global_step == self.step and trainer.global_rank == trainer.world_size - 1:
            os.kill(os.getpid(), signal.SIGKILL)


class _StartStep(L.Callback):
    """Remembers the global step the fit started from (a resumed one: the checkpoint's)."""

    step = -1

    def on_train_start(self, trainer: L.Trainer, *args: object) -> None:
        self.step = trainer.global_step


def cut(
    shared: Path, num_nodes: int, step: str = "5", timeout: str = "10", sleep: str = "4", phase: str = "cut"
) -> None:
    strategy = ZeroStrategy(stage=2, timeout=timedelta(seconds=float(timeout)))
    L.seed_everything(0, verbose=False)
    checkpoints = ModelCheckpoint(shared / "cut_ckpt", every_n_train_steps=CUT_SAVE_EVERY, save_last=True, save_top_k=0)
    start = _StartStep()
    run = trainer(strategy, num_nodes, DEVICES, 100, callbacks=[checkpoints, start], max_steps=CUT_STEPS)
    if phase == "in_save":
        _pause_inside_save(shared, int(step), float(sleep))
    elif phase == "elastic":
        run.callbacks.append(_KillLastRank(int(step)))
    elif phase != "resume":
        run.callbacks.append(_CutPause(shared, int(step), float(sleep)))
    try:
        data = DataLoader(make_regression_data(n=CUT_SAMPLES), batch_size=4)
        run.fit(RegressionModule(), data, ckpt_path="last" if phase in ("resume", "elastic") else None)
    except BaseException as err:
        record_failure(shared / f"{phase}_rank{os.environ.get('RANK', '?')}.json", err)
        raise
    weights = full_state_dict(run.strategy.deepspeed_engine.module)
    if run.global_rank == 0:
        torch.save(
            {"weights": weights, "steps": run.global_step, "started_at": start.step}, shared / f"weights_{phase}.pt"
        )


if __name__ == "__main__":
    mode, shared, nodes = sys.argv[1], Path(sys.argv[2]).resolve(), int(sys.argv[3])
    shared.mkdir(parents=True, exist_ok=True)
    modes = {
        "train": train,
        "reference": reference,
        "resume": resume,
        "slurm": slurm,
        "mismatch": mismatch,
        "hosts": hosts,
        "cut": cut,
    }
    modes[mode](shared, nodes, *sys.argv[4:])
