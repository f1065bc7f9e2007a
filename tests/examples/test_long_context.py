"""examples/long_context.py as a user runs it (2 CPU processes, ``sequence_parallel_size=2``, ZeRO-3): the
validation loss over whole sequences goes down, and the export reloaded with ``from_pretrained`` in one plain process
without sequence parallelism gives the loss the split run logged."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from _support.launch import REPO_ROOT, run_python

SCRIPT = REPO_ROOT / "examples" / "long_context.py"


def test_the_long_context_example_learns_and_its_export_gives_the_same_loss_unsplit(tmp_path: Path) -> None:
    out = run_python(SCRIPT, ["--length", "96", "--steps", "12", "--out", tmp_path], timeout=300).stdout
    before = float(re.search(r"before training: ([\d.]+)", out)[1])  # type: ignore[index]
    after = float(re.search(r"after 12 steps: ([\d.]+)", out)[1])  # type: ignore[index]
    reloaded = float(re.search(r"without sequence parallelism: ([\d.]+)", out)[1])  # type: ignore[index]
    assert after < before - 0.5, out[-2000:]
    assert reloaded == pytest.approx(after, abs=2e-4)
