"""The Trainer's ZeRO-3 (2 CPU ranks, fp32) over validation dataloaders whose ranks run different numbers of batches
(hand-made shards with ``use_distributed_sampler=False``; three dataloaders of different lengths, one of which gives
rank 1 no batch): ``fit`` (its sanity check and validation epoch), ``validate`` and ``predict`` finish instead of
hanging in a forward pass (also a ``generate`` in ``validation_step``), ``GatherForMetrics`` logs exactly the
single-process metrics on every rank, and the parameters are partitioned again after each evaluation (training goes on
after the sanity check)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from _support.launch import REPO_ROOT, run_torchrun
from _support.uneven_evaluation import SHARDS, TIMEOUT_S, expected, per_rank_batches, predictions

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_uneven_evaluation.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("zero_uneven_trainer")
    run_torchrun(SCRIPT, 2, [out], timeout=6 * TIMEOUT_S)  # a hang ends in the strategy's timeout (TIMEOUT_S) first
    return json.loads((out / "trainer.json").read_text())


def _logged(limit: int | None) -> dict[str, float]:
    return {
        f"val/{name}/dataloader_idx_{idx}": value
        for idx in range(len(SHARDS))
        for name, value in expected(idx, limit=limit).items()
    }


def test_every_validation_with_uneven_batches_logs_the_single_process_metrics(ranks: list[dict[str, Any]]) -> None:
    sanity, full = _logged(limit=2), _logged(limit=None)
    assert full["val/count/dataloader_idx_0"] == 10.0 and full["val/count/dataloader_idx_1"] == 7.0
    for rank, facts in enumerate(ranks):
        epochs = facts["epochs"]
        assert [(e["sanity"], e["fn"]) for e in epochs] == [(True, "fit"), (False, "fit"), (False, "validate")]
        assert epochs[0]["batches"] == per_rank_batches(limit=2)[rank]
        for epoch in epochs[1:]:
            assert epoch["batches"] == per_rank_batches()[rank]
        assert epochs[0]["metrics"] == sanity, f"rank {rank}"
        for epoch in epochs[1:]:
            assert epoch["metrics"] == full, f"rank {rank} {epoch['fn']}"


def test_the_ranks_really_ran_different_numbers_of_batches() -> None:
    counts = per_rank_batches()
    assert counts == [[3, 1, 2], [2, 3, 0]]
    assert sum(counts[0]) != sum(counts[1])  # without the fix rank 1's last forward pass waits for rank 0
    assert per_rank_batches(limit=2) == [[2, 1, 2], [2, 2, 0]]  # the sanity check is uneven too


def test_predict_with_uneven_batches_returns_each_ranks_single_process_predictions(
    ranks: list[dict[str, Any]],
) -> None:
    for rank, facts in enumerate(ranks):
        assert facts["predict"] == [predictions(idx, rank)[0].tolist() for idx in range(len(SHARDS))]


def test_the_parameters_are_partitioned_again_after_every_evaluation(ranks: list[dict[str, Any]]) -> None:
    for facts in ranks:
        # by the callbacks' epoch-end hooks (where checkpoints and exports are made) of every validation epoch
        assert [epoch["partitioned_at_epoch_end"] for epoch in facts["epochs"]] == [True] * 3
        # before the first training step (after the sanity check), after fit, validate and predict
        assert facts["partitioned_after"] == [True] * 5


def test_generation_in_the_validation_step_runs_without_synced_gpus_on_the_whole_model(
    ranks: list[dict[str, Any]],
) -> None:
    """Inside the evaluation's gather, forward passes make no collective: ``generate`` needs no ``synced_gpus`` (which
    would wait for ranks that ran out of batches) and ``gathered_for_generation`` no gather of its own."""
    for rank, facts in enumerate(ranks):
        steps = sum(map(sum, (per_rank_batches(limit=2)[rank], per_rank_batches()[rank], per_rank_batches()[rank])))
        assert facts["generation"] == [[True, False]] * steps
