"""An optimizer and scheduler defined in the DeepSpeed config (``configure_optimizers`` returns nothing) train at every
ZeRO stage exactly like the same torch optimizer and DeepSpeed scheduler stepped by hand in one process, with the
scheduler's ``"auto"`` values resolved (peak LR from the config's optimizer, length from the Trainer)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from _support.launch import REPO_ROOT, run_torchrun
from _support.models import make_net, make_regression_data, rank_batches

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_config_optimizer.py"
NAMES = ["zero1", "zero2", "zero3"]
STEPS = 6


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zero_config_optimizer")
    run_torchrun(SCRIPT, 2, [out, STEPS, ",".join(NAMES)], timeout=600)
    return out


def reference() -> tuple[dict[str, torch.Tensor], float]:
    """Plain torch SGD and DeepSpeed's WarmupDecayLR on the same global batches, stepped after every update."""
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    sys.path.insert(0, str(SCRIPT.parent))
    from zero_config_optimizer import OPTIMIZER

    data = make_regression_data()
    net = make_net(0)
    optimizer = torch.optim.SGD(net.parameters(), **OPTIMIZER["params"])
    scheduler = WarmupDecayLR(
        optimizer, total_num_steps=STEPS, warmup_min_lr=0.0, warmup_max_lr=0.05, warmup_num_steps=2
    )
    for step in rank_batches(64, 2, 4, epoch=0)[:STEPS]:
        index = torch.tensor([i for rank_indices in step for i in rank_indices])
        optimizer.zero_grad()
        nn.functional.mse_loss(net(data.tensors[0][index]), data.tensors[1][index]).backward()
        optimizer.step()
        scheduler.step()
    return {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}, optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("name", NAMES)
def test_the_config_optimizer_and_scheduler_train_like_torch_by_hand(runs: Path, name: str) -> None:
    facts = json.loads((runs / f"{name}.json").read_text())
    assert facts["global_step"] == STEPS
    assert facts["scheduler"]["params"]["warmup_max_lr"] == 0.05  # "auto": the config optimizer's lr
    assert facts["scheduler"]["params"]["total_num_steps"] == STEPS  # "auto": the Trainer's steps
    expected, lr = reference()
    assert facts["lr"] == [pytest.approx(lr)]
    weights = torch.load(runs / f"{name}.pt")
    assert set(weights) == set(expected)
    for key, value in expected.items():
        diff = (weights[key] - value).abs().max().item()
        assert diff <= 1e-5, f"{name} {key}: differs from the single-process reference by {diff:.3e}"
    assert (expected["net.0.weight"] - make_net(0).state_dict()["0.weight"]).abs().max() > 1e-3
