"""A mixture-of-experts model in a Fabric loop under ``ZeroFabricStrategy(stage=3)`` whose ranks route their tokens
to different experts at every step: ``fabric.setup`` marks its MoE block as a ZeRO-3 leaf module before the engine is
built, and the run equals one plain process (fp32, 2 CPU ranks, <= 1e-5). Without the marking the first step fails
(DeepSpeed#7461); ``fabric_moe.py OUT none`` shows it."""

from __future__ import annotations

from pathlib import Path

from _support import moe
from _support.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "fabric" / "scripts" / "fabric_moe.py"


def test_a_moe_model_whose_ranks_use_different_experts_trains_like_one_process_under_zero3(tmp_path: Path) -> None:
    proc = run_torchrun(SCRIPT, moe.WORLD, [tmp_path], env={"LIGHTSPEED_LOG_LEVEL": "INFO"}, timeout=300)
    moe.check_run(proc, tmp_path)
