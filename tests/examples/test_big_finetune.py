"""examples/big_finetune.py as a user runs it, at a tiny size (zero3_nvme, 2 CPU processes): the pretrained model is
written sharded, every weight is fine-tuned, the partitioned model generates, and the export loads with
``from_pretrained`` and generates the same tokens."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _support.launch import REPO_ROOT, run_python

SCRIPT = REPO_ROOT / "examples" / "big_finetune.py"
NEW_TOKENS = 6
TINY = ["--hidden", "64", "--layers", "2", "--vocab", "256", "--context", "16", "--steps", "2"]
TINY += ["--shard-size", "200KB", "--new-tokens", str(NEW_TOKENS)]


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _tokens(out: str, label: str) -> list[int]:
    found = re.search(rf"^{label}: (\[.*\])$", out, re.MULTILINE)
    assert found, out[-3000:]
    return ast.literal_eval(found[1])


def test_the_nvme_finetuning_example_trains_generates_exports_and_reloads(tmp_path: Path) -> None:
    from lightspeed.core.zero.runtime import async_io_problem

    if (problem := async_io_problem()) is not None:
        pytest.skip(f"NVMe offload cannot run here: {problem}")
    out = run_python(SCRIPT, [*TINY, "--out", tmp_path], timeout=600).stdout
    pretrained, export = tmp_path / "pretrained", tmp_path / "export"
    assert (pretrained / "model.safetensors.index.json").is_file()  # sharded, as published checkpoints are
    assert len(list(pretrained.glob("model-*-of-*.safetensors"))) > 1
    assert (export / "config.json").is_file()

    before, after = _weights(pretrained), _weights(export)
    assert sorted(after) == sorted(before)
    unchanged = [key for key in before if torch.equal(before[key], after[key])]
    assert not unchanged, f"not fine-tuned: {unchanged}"

    partitioned = _tokens(out, "generated while partitioned")
    assert len(partitioned) == NEW_TOKENS
    assert _tokens(out, "generated after from_pretrained") == partitioned
