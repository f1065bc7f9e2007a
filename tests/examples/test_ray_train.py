"""examples/ray_train.py as a user runs it (Ray Train, 2 CPU workers, ZeRO-3): it trains, Ray keeps a checkpoint with
every worker's shard, and the export of that checkpoint reloads into a plain model that predicts better than a
uniform guess."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("ray.train", reason="needs Ray Train: pip install 'lightspeed[ray]'")

from _support.launch import REPO_ROOT, run_python  # noqa: E402

SCRIPT = REPO_ROOT / "examples" / "ray_train.py"


def test_the_ray_example_trains_keeps_a_checkpoint_and_exports(tmp_path: Path) -> None:
    run = run_python(SCRIPT, ["--epochs", "1", "--lines", "1500", "--out", tmp_path], timeout=600)
    assert "Ray Train: 2 workers, ZeRO-3, last checkpoint" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    found = re.search(
        r"reloaded into a plain model: validation perplexity ([\d.]+) \(uniform guess: (\d+)\)", run.stdout
    )
    assert found, run.stdout[-3000:]
    assert float(found.group(1)) < int(found.group(2)) / 2  # it learned: far better than guessing
    assert (tmp_path / "export" / "model.safetensors").is_file()
