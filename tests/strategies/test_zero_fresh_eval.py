"""validate/test/predict from a ZeRO checkpoint in a process that did not train: every stage and offload setting, on
the world size that wrote the checkpoint and on another one, equal to the training process's own evaluation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from _support.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_fresh_eval.py"
NAMES = ["stage0", "zero1", "zero2_offload", "zero3", "zero3_offload"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fresh_eval")
    run_torchrun(SCRIPT, 2, ["train", out, ",".join(NAMES)])
    missing = out / "missing.ckpt"
    shutil.copytree(out / "ckpt" / "zero2_offload" / "last.ckpt", missing)
    (missing / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    run_torchrun(SCRIPT, 2, ["eval", out, ",".join(NAMES), "eval2", "--missing", missing])
    run_torchrun(SCRIPT, 1, ["eval", out, ",".join(NAMES), "eval1"])
    return out


def _facts(runs: Path, tag: str, name: str) -> dict:
    return json.loads((runs / tag / f"{name}.json").read_text())


@pytest.mark.parametrize("name", NAMES)
def test_fresh_evaluation_on_two_ranks_equals_the_training_process(runs: Path, name: str) -> None:
    trained, fresh = _facts(runs, "train", name), _facts(runs, "eval2", name)
    assert trained["global_step"] == 8
    assert fresh["val_loss"] == pytest.approx(trained["val_loss"], abs=1e-6)
    assert fresh["test_loss"] == pytest.approx(trained["test_loss"], abs=1e-6)
    for rank in (0, 1):
        expected = torch.load(runs / "train" / f"{name}.rank{rank}.pt")
        got = torch.load(runs / "eval2" / f"{name}.rank{rank}.pt")
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_fresh_evaluation_on_one_rank_of_a_two_rank_checkpoint(runs: Path, name: str) -> None:
    trained, fresh = _facts(runs, "train", name), _facts(runs, "eval1", name)
    assert fresh["world_size"] == 1
    assert fresh["val_loss"] == pytest.approx(trained["val_loss"], abs=1e-6)
    assert fresh["test_loss"] == pytest.approx(trained["test_loss"], abs=1e-6)
    predictions = torch.load(runs / "eval1" / f"{name}.rank0.pt")
    assert predictions.shape == (64, 5)
    for rank in (0, 1):  # an unshuffled DistributedSampler gives rank r the samples r, r+2, ...
        expected = torch.load(runs / "train" / f"{name}.rank{rank}.pt")
        torch.testing.assert_close(predictions[rank::2], expected, atol=1e-6, rtol=0)


def test_the_fresh_model_really_started_elsewhere(runs: Path) -> None:
    from _support.models import RegressionModule, make_regression_data

    x, y = make_regression_data().tensors
    with torch.no_grad():
        untrained = torch.nn.functional.mse_loss(RegressionModule(seed=7)(x), y).item()
    assert abs(untrained - _facts(runs, "train", "zero3")["val_loss"]) > 1e-2


def test_a_missing_rank_file_is_named_on_every_rank(runs: Path) -> None:
    tag_dir = runs / "missing.ckpt" / "checkpoint"
    expected = (
        f"CheckpointError: {tag_dir} is missing the optimizer file of rank(s) [1] "
        "(zero_pp_rank_1_mp_rank_00_optim_states.pt); the checkpoint was saved by 2 ranks and every rank's file is "
        "needed"
    )
    for rank in (0, 1):
        assert (runs / "eval2" / f"missing.rank{rank}.txt").read_text() == expected


@pytest.mark.parametrize("tag", ["eval2", "eval1"])
def test_process_group_stays_after_evaluation_and_a_later_fit_works(runs: Path, tag: str) -> None:
    # the group lightspeed created stays up after a run (ZeRO-3 modules stay partitioned over it, and the user's own
    # torch.distributed calls use it); it is destroyed at interpreter exit (tests/strategies/test_zero_clean_exit.py)
    for name in NAMES:
        assert _facts(runs, tag, name)["group_after_validate"] is True, name
    refit = json.loads((runs / tag / "refit.json").read_text())
    assert refit["global_step"] == 2 and refit["val_loss"] > 0
