"""A Fabric loop under ZeRO-3 (2 CPU ranks, fp32) evaluating two dataloaders of different lengths whose ranks run
different numbers of batches: inside ``lightspeed.gathered_for_evaluation`` it finishes instead of hanging in a
forward pass, one ``gather_for_metrics`` per dataloader after its loop and ``exact_metrics`` (also over a third
dataloader that gives rank 1 no batch) give exactly the single-process metrics on every rank, the engine trains on
afterwards, and ``enabled=False`` is an ``UnevenEvaluationError`` on every rank."""

from __future__ import annotations

import json
from typing import Any

import pytest

from _support.launch import REPO_ROOT, run_torchrun
from _support.uneven_evaluation import FABRIC_LOADERS, SHARDS, TIMEOUT_S, expected, per_rank_batches

SCRIPT = REPO_ROOT / "tests" / "fabric" / "scripts" / "fabric_uneven_evaluation.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("zero_uneven_fabric")
    run_torchrun(SCRIPT, 2, [out], timeout=6 * TIMEOUT_S)  # a hang ends in the strategy's timeout (TIMEOUT_S) first
    return json.loads((out / "fabric.json").read_text())


def test_uneven_evaluation_gathers_the_model_and_gives_the_single_process_metrics(ranks: list[dict[str, Any]]) -> None:
    reference = [expected(idx) for idx in range(FABRIC_LOADERS)]
    batches = per_rank_batches(loaders=range(FABRIC_LOADERS))
    assert batches == [[3, 1], [2, 3]]  # unequal per dataloader and in total
    for rank, facts in enumerate(ranks):
        for evaluation in facts["evaluations"]:  # before and after a training step
            assert evaluation["gathered"] is True
            assert evaluation["batches"] == batches[rank]
            assert evaluation["metrics"] == reference, f"rank {rank}"
            assert evaluation["exact"] == [expected(idx) for idx in range(len(SHARDS))], f"rank {rank}"


def test_the_parameters_are_partitioned_again_after_the_evaluation(ranks: list[dict[str, Any]]) -> None:
    for facts in ranks:
        assert facts["partitioned_after"] == [True, True]


def test_uneven_batches_on_a_model_that_may_not_be_gathered_raise_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for facts in ranks:
        message = facts["disabled"]
        assert message.startswith(
            "UnevenEvaluationError: Evaluation under ZeRO-3 with a different number of batches per rank (rank 0: 3, 1; "
            "rank 1: 2, 3 batches per dataloader) would hang"
        ), message
        assert "gathering is turned off (enabled=False)" in message
        assert message.endswith('or enabled="auto".')
