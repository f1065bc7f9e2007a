"""Elastic restarts (torchrun --max-restarts): a rank SIGKILLed mid-step, mid-save or mid-validation; torchrun
restarts both ranks, ``fit(ckpt_path="last")`` resumes from the last complete checkpoint (a fresh start on the first
attempt), mid-epoch with the data position restored, and the run ends with the weights of an uninterrupted run. The
same for a Fabric loop that saves with ``fabric.save`` and resumes from ``lightspeed.fabric.last_checkpoint``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _elastic import failure, run_elastic

from lightspeed.core.reliability.staging import require_complete

TOLERANCE = 1e-6


def _attempts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]


def _assert_same_weights(out: Path) -> None:
    weights = torch.load(out / "weights.pt")
    assert weights["steps"] == 24
    assert weights["elastic"].keys() == weights["reference"].keys()
    for key, expected in weights["reference"].items():
        diff = (weights["elastic"][key] - expected).abs().max().item()
        assert diff <= TOLERANCE, f"{key}: the restarted run differs from the uninterrupted run by {diff:.3e}"


@pytest.mark.parametrize(
    ("strategy", "faults", "starts"),
    [
        # rank 1 killed at batch 5 of epoch 1 (step 14; last checkpoint: step 12, mid-epoch), then killed during the
        # validation of epoch 2 (last checkpoint: step 24, the epoch's last batch)
        ("ddp_exact", "0:step,1:val", [(0, 0), (12, 4), (24, 8)]),
        # killed mid-step, then killed mid-save of step 15 after writing its shard: the restart uses step 12 again
        ("zero3", "0:step,1:save", [(0, 0), (12, 4), (12, 4)]),
    ],
)
def test_a_killed_rank_is_restarted_and_the_run_ends_as_if_uninterrupted(
    tmp_path: Path, strategy: str, faults: str, starts: list[tuple[int, int]]
) -> None:
    proc = run_elastic("elastic_fit.py", 2, [tmp_path, strategy, faults], max_restarts=2)
    assert proc.returncode == 0, failure(proc)
    attempts = _attempts(tmp_path)
    assert [a["attempt"] for a in attempts] == list(range(len(starts)))
    assert [(a["global_step"], a["batch"]) for a in attempts] == starts
    _assert_same_weights(tmp_path)
    final = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    assert final == ["epoch=2-step=24.ckpt", "last.ckpt"]  # no staging leftovers
    if "save" in faults:
        assert "epoch=1-step=15.ckpt.lightspeed-staging" in attempts[2]["checkpoints"]  # the half-written save ...
        assert "epoch=1-step=15.ckpt" not in attempts[2]["checkpoints"]  # ... never became a checkpoint
    if strategy != "ddp_exact":
        for name in final:
            require_complete(tmp_path / "ckpts" / name)


@pytest.mark.parametrize(
    ("strategy", "faults", "starts"),
    [
        # rank 1 killed before step 14 (last checkpoint: step 12, mid-epoch), the optimizer offloaded (the Trainer's
        # runs above kill during validation and during a save; the restart machinery is the same core)
        ("zero2_offload", "0:step", [0, 12]),
    ],
)
def test_a_killed_rank_in_a_fabric_loop_is_restarted_and_the_loop_ends_as_if_uninterrupted(
    tmp_path: Path, strategy: str, faults: str, starts: list[int]
) -> None:
    proc = run_elastic("fabric_loop.py", 2, ["elastic", tmp_path, strategy, faults], max_restarts=2)
    assert proc.returncode == 0, failure(proc)
    attempts = _attempts(tmp_path)
    assert [a["attempt"] for a in attempts] == list(range(len(starts)))
    assert [a["step"] for a in attempts] == starts
    _assert_same_weights(tmp_path)
    final = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    assert final == sorted(f"step={step}.ckpt" for step in range(3, 25, 3))  # no staging leftovers
    if "save" in faults:
        assert "step=15.ckpt.lightspeed-staging" in attempts[2]["checkpoints"]  # the half-written save ...
        assert "step=15.ckpt" not in attempts[2]["checkpoints"]  # ... never became a checkpoint
    if strategy != "ddp_exact":
        for name in final:
            require_complete(tmp_path / "ckpts" / name)
