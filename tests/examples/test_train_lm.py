"""examples/train_lm.py (the README's main job, `bash scripts/run_example.sh`) as a user runs it, at a tiny size, under
its default strategy (``zero3_offload``; ``zero2``, the other its docstring offers, only changes the preset): it
trains on 2 CPU processes, evaluates over exactly the validation set and exports weights that, reloaded into a fresh
model without DeepSpeed, give the same perplexity (the script exits 1 otherwise)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from _support.launch import REPO_ROOT, run_python

SCRIPT = REPO_ROOT / "examples" / "train_lm.py"
TINY = ["--lines", "300", "--epochs", "1", "--batch-size", "8", "--devices", "2"]


@pytest.mark.parametrize("strategy", ["zero3_offload"])
def test_the_main_example_trains_evaluates_and_exports(tmp_path: Path, strategy: str) -> None:
    run = run_python(SCRIPT, [*TINY, "--strategy", strategy, "--out", tmp_path], timeout=300)
    assert re.search(r"validation over all \d+ windows \(no duplicates\): next-token accuracy [\d.]+", run.stdout), (
        run.stdout[-3000:]
    )
    assert "matches the distributed evaluation" in run.stdout, run.stdout[-3000:]
    assert (tmp_path / "export" / "model.safetensors").is_file()
