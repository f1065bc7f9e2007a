"""Once lightspeed is imported, a gloo default process group ends before interpreter finalization, also one
Lightning's own ``ddp`` created (no gloo worker thread left for finalization: pytorch/pytorch#190489)."""

from __future__ import annotations

import json
from pathlib import Path

from _support.launch import REPO_ROOT, run_python

SCRIPT = REPO_ROOT / "tests" / "core" / "reliability" / "scripts" / "ddp_exit.py"


def test_lightnings_ddp_group_is_destroyed_at_exit_once_lightspeed_is_imported(tmp_path: Path) -> None:
    run_python(SCRIPT, [tmp_path], timeout=300)
    reports = {path.name: json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))}
    assert reports == {"rank0.json": {"group_alive": False}, "rank1.json": {"group_alive": False}}
