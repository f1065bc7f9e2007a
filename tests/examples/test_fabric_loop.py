"""examples/fabric_loop.py as a user runs it (2 CPU processes): one epoch, then a second invocation that resumes from
the checkpoint `fabric.save` wrote, trains on and exports weights that load into a plain model."""

from __future__ import annotations

import re
from pathlib import Path

from safetensors.torch import load_file

from _support.launch import REPO_ROOT, run_python

SCRIPT = REPO_ROOT / "examples" / "fabric_loop.py"


def perplexities(output: str) -> dict[int, float]:
    return {int(e): float(p) for e, p in re.findall(r"epoch (\d+): validation perplexity ([\d.]+)", output)}


def test_the_fabric_example_trains_resumes_and_exports(tmp_path: Path) -> None:
    first = run_python(SCRIPT, ["--epochs", "1", "--out", tmp_path], timeout=600)
    assert list(perplexities(first.stdout)) == [0], first.stdout[-3000:]
    second = run_python(SCRIPT, ["--epochs", "2", "--out", tmp_path], timeout=600)
    assert f"resumed from {tmp_path / 'last.ckpt'} after epoch 1" in second.stdout, second.stdout[-3000:]
    assert list(perplexities(second.stdout)) == [1], second.stdout[-3000:]
    assert perplexities(second.stdout)[1] < perplexities(first.stdout)[0]
    assert f"to {tmp_path / 'export'}; reloaded into a plain TinyGPT" in second.stdout
    assert "tokens.weight" in load_file(tmp_path / "export" / "model.safetensors")


def test_the_fabric_example_builds_its_encoder_partitioned_under_zero3_offload(tmp_path: Path) -> None:
    """The strategy the example's docstring and docs/fabric.md name: its ``nn.TransformerEncoder`` deep-copies its
    layer under ``fabric.init_module()``."""
    run = run_python(SCRIPT, ["--strategy", "zero3_offload", "--epochs", "1", "--out", tmp_path], timeout=600)
    assert list(perplexities(run.stdout)) == [0], run.stdout[-3000:]
    assert "ZeRO-3, optimizer states on cpu, parameters on cpu" in run.stdout + run.stderr
    assert "tokens.weight" in load_file(tmp_path / "export" / "model.safetensors")
