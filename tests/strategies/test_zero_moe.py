"""A mixture-of-experts model under ``ZeroStrategy(stage=3)`` whose ranks route their tokens to different experts
at every step (and in one step no token reaches two of them): its MoE block is found and marked as a ZeRO-3 leaf
module before the engine is built, and the run equals one plain process (fp32, 2 CPU ranks, <= 1e-5); so does
ZeRO-1's. Without the marking the first step fails ("Detected a
disagreement on list contents between rank0 and rank1", DeepSpeed#7461); ``zero_moe.py OUT none`` shows it."""

from __future__ import annotations

from pathlib import Path

import torch

from _support import moe
from _support.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_moe.py"


def test_a_moe_model_whose_ranks_use_different_experts_trains_like_one_process_under_zero1_and_zero3(
    tmp_path: Path,
) -> None:
    """ZeRO-1 used to end 6e-2 away: each rank reduced only the experts it used, so gradients were added to other
    parameters' (and the experts no token reached took an AdamW step on a zero gradient)."""
    proc = run_torchrun(SCRIPT, moe.WORLD, [tmp_path], env={"LIGHTSPEED_LOG_LEVEL": "INFO"}, timeout=300)
    moe.check_run(proc, tmp_path)
    moe.close(torch.load(tmp_path / "result.pt")["zero1"])
