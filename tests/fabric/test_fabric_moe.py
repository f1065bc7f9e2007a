"""A mixture-of-experts model in a Fabric loop under ``ZeroFabricStrategy(stage=3)`` whose ranks route their tokens
to different experts at every step (and in one step no token reaches two of them): ``fabric.setup`` marks its MoE
block as a ZeRO-3 leaf module before the engine is built, and the run equals one plain process (fp32, 2 CPU ranks,
<= 1e-5); so does ZeRO-1's. Without the marking the first step fails
(DeepSpeed#7461); ``fabric_moe.py OUT none`` shows it."""

from __future__ import annotations

from pathlib import Path

import torch

from _support import moe
from _support.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "fabric" / "scripts" / "fabric_moe.py"


def test_a_moe_model_whose_ranks_use_different_experts_trains_like_one_process_under_zero1_and_zero3_not_zero2(
    tmp_path: Path,
) -> None:
    """ZeRO-1 used to end 6e-2 away: each rank reduced only the experts it used, so gradients were added to other
    parameters' (and the experts no token reached took an AdamW step on a zero gradient). ZeRO-2 reduces during the
    backward, in arrival order: refused at the first backward whose ranks used different experts."""
    proc = run_torchrun(SCRIPT, moe.WORLD, [tmp_path], env={"LIGHTSPEED_LOG_LEVEL": "INFO"}, timeout=300)
    moe.check_run(proc, tmp_path)
    result = torch.load(tmp_path / "result.pt")
    moe.close(result["zero1"])
    warning = (
        "lightspeed: moe: mixture-of-experts blocks under ZeRO-2, which reduces gradients in the order they arrive: a "
        "backward in which the ranks' tokens reach different experts will be an error. ZeRO-1 without optimizer "
        "offload and ZeRO-3 train such blocks exactly."
    )
    assert (proc.stdout + proc.stderr).count(warning) == 1  # when the engine is built, rank 0
    assert result["zero2_error"] == (
        "Some ranks used moe.experts.0.0.weight, moe.experts.0.0.bias, moe.experts.0.2.weight, moe.experts.0.2.bias, "
        "moe.experts.1.0.weight and 11 more in this backward and others did not (ranks whose tokens reach different "
        "experts, or that skip different layers). This ZeRO-2 run reduces gradients in the order they arrive during "
        "the backward, so these sums would be wrong. Use ZeRO-1 without optimizer offload (lightspeed reduces every "
        "parameter at the window's end in a fixed order, with a zero gradient where a rank has none) or ZeRO-3 "
        "(mixture-of-experts blocks are marked as leaf modules)."
    )
