"""The core accumulation API in a plain PyTorch DDP loop on 2 real gloo ranks, against a single-process reference."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from _support.launch import run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "accumulation_plain_ddp.py"
_spec = importlib.util.spec_from_file_location(
    "accumulation_cases", Path(__file__).parents[2] / "strategies" / "scripts" / "accumulation_cases.py"
)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


def test_plain_ddp_loop_with_uneven_tokens_matches_the_big_batch_and_syncs_once_per_window(tmp_path):
    run_torchrun(SCRIPT, 2, [tmp_path])
    result = torch.load(tmp_path / "plain_ddp.pt")

    data = cases.make_data("tokens")
    model = cases.make_model("tokens")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = cases.windows(len(data[0]), 2, 2, 4)  # 6 batches per rank: windows of 4 and 2
    for _ in range(2):
        for indices in steps:
            optimizer.zero_grad()
            loss_sum, tokens = cases.item_loss("tokens", model, tuple(t[indices] for t in data))
            (loss_sum / tokens).backward()
            optimizer.step()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(result["state_dict"][key], value, rtol=0.0, atol=1e-6)
    assert result["steps"] == 4
    assert result["grad_allreduces"] == 4  # skip_gradient_sync kept non-boundary micro-batches local
    assert result["count_allreduces"] == 4
