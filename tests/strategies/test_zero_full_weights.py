"""``ZeroStrategy(stage=3, load_full_weights=True)``: resuming from a consolidated single-process Lightning checkpoint
loads the weights into the partitioned model and into the optimizer's fp32 master copies, so the next step starts
from the loaded weights (Lightning's own restore leaves the masters at the weights from before the load)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from _support.launch import REPO_ROOT, run_torchrun
from _support.models import make_regression_data
from _support.trainers import quiet_trainer

SCRIPTS = REPO_ROOT / "tests" / "strategies" / "scripts"
sys.path.insert(0, str(SCRIPTS))
from zero_full_weights_model import LR, ProbeModule, probe_loss  # noqa: E402

from _support.models import make_net  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("zero_full_weights")
    single = quiet_trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
    )
    single.fit(ProbeModule(seed=9), DataLoader(make_regression_data(16), batch_size=2))
    single.save_checkpoint(out / "single.ckpt")
    saved = {k: v.detach().clone() for k, v in single.lightning_module.state_dict().items()}
    for offload in ("none", "cpu"):
        run_torchrun(SCRIPTS / "zero_full_weights.py", 2, [out / "single.ckpt", out, offload], timeout=600)
    return out, saved


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_the_step_after_loading_full_weights_starts_from_them(
    runs: tuple[Path, dict[str, torch.Tensor]], offload: str
) -> None:
    out, saved = runs
    result = torch.load(out / f"{offload}.pt")
    assert result["global_step"] == 2
    net = make_net()
    net.load_state_dict({k.removeprefix("net."): v for k, v in saved.items()})
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    probe_loss(net).backward()
    optimizer.step()
    for key, expected in net.state_dict().items():
        diff = (result["weights"][f"net.{key}"] - expected).abs().max().item()
        assert diff <= 1e-6, f"{key}: the step did not start from the loaded weights (off by {diff:.3e})"
