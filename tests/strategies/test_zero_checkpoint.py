"""Checkpoints through the Trainer: exact resume, evaluation on the training engine, and crash-safe saving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from _support.launch import REPO_ROOT, run_torchrun
from _support.models import make_net, make_regression_data
from lightspeed.core.errors import IncompleteCheckpointError
from lightspeed.core.reliability.staging import COMPLETE_MARKER, require_complete, staging_path

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_checkpoint.py"


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zero_resume")
    run_torchrun(SCRIPT, 2, ["resume", out, "zero3_offload"])
    return out


def test_resume_from_last_gives_the_uninterrupted_weights(resumed: Path) -> None:
    facts = json.loads((resumed / "facts.json").read_text())
    weights = torch.load(resumed / "weights.pt")
    assert facts["full_step"] == facts["resumed_step"] == 16
    for key, expected in weights["full"].items():
        diff = (weights["resumed"][key] - expected).abs().max().item()
        assert torch.equal(weights["resumed"][key], expected), (
            f"{key}: resumed run differs from the uninterrupted by {diff:.3e}"
        )
    assert (weights["full"]["net.0.weight"] - make_net().state_dict()["0.weight"]).abs().max() > 1e-3


def test_checkpoints_are_complete_and_carry_the_resolved_config(resumed: Path) -> None:
    facts = json.loads((resumed / "facts.json").read_text())
    assert "last.ckpt" in facts["checkpoints"]
    assert not any("staging" in name for name in facts["checkpoints"])
    for name in facts["checkpoints"]:
        ckpt = resumed / "ckpts" / name
        require_complete(ckpt)
        config = json.loads((ckpt / "ds_config.json").read_text())
        assert config["zero_optimization"]["stage"] == 3
        assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
        assert config["train_micro_batch_size_per_gpu"] == 4
        assert (ckpt / "checkpoint").is_dir()


def test_evaluation_after_fit_reuses_the_training_engine(resumed: Path) -> None:
    facts = json.loads((resumed / "facts.json").read_text())
    weights = torch.load(resumed / "weights.pt")
    assert facts["same_engine_validate"] and facts["same_engine_predict"]
    net = make_net()
    net.load_state_dict({k.removeprefix("net."): v for k, v in weights["resumed"].items()})
    data = make_regression_data()
    x, y = data.tensors
    with torch.no_grad():
        expected_loss = nn.functional.mse_loss(net(x), y).item()
        expected_rank0 = net(x[0::2])  # rank 0's shard of an unshuffled DistributedSampler
    assert facts["val_loss"] == pytest.approx(expected_loss, abs=1e-6)
    assert facts["test_loss"] == pytest.approx(expected_loss, abs=1e-6)
    torch.testing.assert_close(weights["predictions"], expected_rank0, atol=1e-6, rtol=0)


def test_a_rank_dying_mid_save_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    proc = run_torchrun(SCRIPT, 2, ["crash", tmp_path, "zero2"], check=False)
    assert proc.returncode != 0
    target = tmp_path / "model.ckpt"
    require_complete(target)  # the first, complete checkpoint is still in place
    manifest = json.loads((target / COMPLETE_MARKER).read_text())
    assert manifest["epoch"] == 1 and manifest["global_step"] == 8 and manifest["world_size"] == 2
    staging = staging_path(target)
    assert staging.is_dir(), "the interrupted save should have left its staging directory behind"
    with pytest.raises(IncompleteCheckpointError, match="was not written completely"):
        require_complete(staging)


def test_a_save_error_on_one_rank_is_raised_on_every_rank(tmp_path: Path) -> None:
    run_torchrun(SCRIPT, 2, ["save_error", tmp_path, "zero2"], timeout=600)
    target = str(tmp_path / "model.ckpt")
    assert (tmp_path / "rank0.txt").read_text() == f"PermissionError: [Errno 13] Permission denied: {target!r}"
    assert (
        (tmp_path / "rank1.txt")
        .read_text()
        .startswith(f"RuntimeError: Saving checkpoint {target!r} failed on another rank")
    )
    manifest = json.loads((tmp_path / "model.ckpt" / COMPLETE_MARKER).read_text())
    assert manifest["global_step"] == 8  # the complete checkpoint from before is still there
