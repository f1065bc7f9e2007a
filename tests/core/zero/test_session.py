"""The ZeRO session alone, driven by a plain PyTorch loop without Lightning (as a Ray Train worker would): its engine
trains as torch's AdamW does, and its staged checkpoint is committed, exportable and loads back into a fresh model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _support.launch import REPO_ROOT, run_python

SCRIPT = REPO_ROOT / "tests" / "core" / "zero" / "scripts" / "session_alone.py"


@pytest.mark.parametrize("stage", [2, 3])
def test_a_session_without_lightning_trains_saves_and_exports_like_plain_torch(tmp_path: Path, stage: int) -> None:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env["LIGHTSPEED_LOG_LEVEL"] = "debug"  # the whole config at DEBUG, on stderr
    proc = run_python(SCRIPT, [tmp_path, stage], env=env, timeout=600)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["difference"] <= 1e-6, result["difference"]
    assert result["global_steps"] == 4
    assert "lightspeed_complete.json" in result["committed"], result["committed"]
    assert not list(tmp_path.glob(".*staging*")), list(tmp_path.iterdir())
    # one INFO line sums the config up; the whole config goes to the `lightspeed` logger at DEBUG, here switched on
    assert result["logged"] == [
        f"lightspeed: DeepSpeed config: ZeRO-{stage}, micro-batch 4 x 1 accumulated, fp32, no clipping (the whole "
        "config: LIGHTSPEED_LOG_LEVEL=DEBUG; saved as ds_config.json in every checkpoint)"
    ]
    assert "lightspeed DEBUG: resolved DeepSpeed config\n{" in proc.stderr, proc.stderr
    assert f'"stage": {stage}' in proc.stderr
