"""Storage faults: a full disk while saving (every rank fails at once: the full rank with its own error, the others
naming the failed save; torchrun restarts, the run resumes from the previous complete checkpoint and sweeps the
half-written one) and a truncated shard (the same
error on every rank, naming the file, before any step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _elastic import failure, run_elastic


@pytest.fixture(scope="module")
def facts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    out = tmp_path_factory.mktemp("save_faults")
    proc = run_elastic("save_faults.py", 2, [out], max_restarts=1)
    assert proc.returncode == 0, failure(proc)
    return out, {p.stem: json.loads(p.read_text()) for p in out.glob("attempt*_rank*.json")}


def test_a_full_disk_during_save_fails_every_rank_and_the_restart_resumes_from_the_previous_checkpoint(
    facts: tuple[Path, dict[str, dict]],
) -> None:
    out, seen = facts
    assert sorted(seen) == ["attempt0_rank0", "attempt0_rank1", "attempt1_rank0", "attempt1_rank1"]
    errors = [seen[f"attempt0_rank{rank}"]["error"] for rank in (0, 1)]
    # rank 1's disk is full: its own error; rank 0 learns at once (not after the timeout) that the save failed
    assert errors[1].startswith("OSError: [Errno 28] No space left on device"), errors
    assert errors[0].startswith("RuntimeError: Saving checkpoint "), errors
    assert errors[0].endswith(
        "failed on another rank (its own error says why); the previous checkpoint is untouched."
    ), errors
    for rank in (0, 1):
        restarted = seen[f"attempt1_rank{rank}"]
        assert restarted["checkpoints_at_start"] == [
            "epoch=0-step=2.ckpt",
            "epoch=0-step=4.ckpt.lightspeed-staging",  # the save that hit the full disk, never committed
            "last.ckpt",
        ]
        assert restarted["resumed_from"] == 2 and restarted["final_step"] == 6
        assert restarted["after_resume"] == ["epoch=0-step=6.ckpt", "last.ckpt"]  # the leftover was swept


def test_a_truncated_shard_is_one_error_on_every_rank_before_any_step(facts: tuple[Path, dict[str, dict]]) -> None:
    out, seen = facts
    last = out / "ckpts" / "last.ckpt"
    for rank in (0, 1):
        restarted = seen[f"attempt1_rank{rank}"]
        assert restarted["truncated"].startswith(
            f"IncompleteCheckpointError: Checkpoint {str(last)!r} is damaged: "
            "checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt ("
        )
        assert restarted["truncated"].endswith(
            "It changed after it was written (a truncated copy, a full disk while copying, or a file replaced). "
            "Resume from an earlier checkpoint."
        )
        assert restarted["truncated_batches"] == 0
