"""HuggingFace's ``gradient_checkpointing_enable()`` under every ZeRO stage (2 CPU ranks, fp32): the weights after 3
steps equal the run without checkpointing (recomputing activations changes no gradient), and training moved them."""

from __future__ import annotations

import sys

import pytest
import torch

from _support.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_activation_checkpointing.py"
sys.path.insert(0, str(SCRIPT.parent))
import zero_activation_checkpointing as worker  # noqa: E402

NAMES = ["zero1", "zero2", "zero3", "zero3_offload"]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("zero_activation_checkpointing")
    run_torchrun(SCRIPT, 2, [out, ",".join(NAMES)], timeout=600)
    return torch.load(out / "weights.pt")


@pytest.mark.parametrize("name", NAMES)
def test_hf_gradient_checkpointing_trains_like_without_it(weights: dict[str, torch.Tensor], name: str) -> None:
    plain = {k.removeprefix(f"{name}.plain."): v for k, v in weights.items() if k.startswith(f"{name}.plain.")}
    ckpt = {k.removeprefix(f"{name}.ckpt."): v for k, v in weights.items() if k.startswith(f"{name}.ckpt.")}
    assert plain.keys() == ckpt.keys() and plain
    for key in plain:
        diff = (plain[key] - ckpt[key]).abs().max().item()
        assert diff <= 1e-5, f"{name} {key}: checkpointing changed the weights by {diff:.3e}"
    start = worker.tiny_lm().state_dict()["transformer.h.0.mlp.c_fc.weight"]
    assert (ckpt["model.transformer.h.0.mlp.c_fc.weight"] - start).abs().max() > 1e-3  # training moved them
