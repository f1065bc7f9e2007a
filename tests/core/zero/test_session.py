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
    run_python(
        SCRIPT,
        [tmp_path, stage],
        env={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"},
        timeout=600,
    )
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["difference"] <= 1e-6, result["difference"]
    assert result["global_steps"] == 4
    assert "lightspeed_complete.json" in result["committed"], result["committed"]
    assert not list(tmp_path.glob(".*staging*")), list(tmp_path.iterdir())
    assert len(result["logged"]) == 1 and result["logged"][0].startswith("lightspeed: resolved DeepSpeed config")
    assert f'"stage": {stage}' in result["logged"][0]
