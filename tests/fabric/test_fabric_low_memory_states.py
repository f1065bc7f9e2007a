"""DeepSpeed's low-memory bf16 states as strategy arguments, on 2 CPU ranks under Fabric's ZeRO-2 (bf16-mixed):
``bf16_master_weights_and_grads`` keeps the master partitions in bf16 (with the optimizer offloaded, its moments stay
fp32 in DeepSpeed's CPU Adam), ``bf16_optimizer_states`` the moments too (with and without offload); the optimizer
holds half the bytes, and training follows the fp32-master run closely; a run with fp32 moments beside bf16 master
weights resumed through ``fabric.save`` / ``fabric.load`` ends with the uninterrupted run's weights bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _support.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "fabric" / "scripts" / "zero_low_memory_states.py"
STEPS = 4


@pytest.fixture(scope="module", params=["none", "cpu"])
def variants(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp(f"low_memory_{request.param}") / "result.pt"
    run_torchrun(SCRIPT, 2, [out, 2, request.param, STEPS], timeout=600)
    return request.param, torch.load(out)


def test_the_optimizer_holds_bf16_master_weights_and_states_as_asked(variants: tuple[str, dict[str, Any]]) -> None:
    offload, results = variants
    fp32 = results["fp32_master"]
    assert (fp32["master_dtypes"], fp32["state_dtypes"]) == (["torch.float32"], ["torch.float32"])
    both = results["bf16_master_and_states"]
    assert (both["master_dtypes"], both["state_dtypes"]) == (["torch.bfloat16"], ["torch.bfloat16"])
    assert both["master_bytes"] * 2 == fp32["master_bytes"] and both["state_bytes"] * 2 == fp32["state_bytes"]
    if offload == "cpu":  # bf16 master weights alone: DeepSpeed's CPU Adam keeps fp32 moments
        master = results["bf16_master"]
        assert (master["master_dtypes"], master["state_dtypes"]) == (["torch.bfloat16"], ["torch.float32"])
        assert master["master_bytes"] * 2 == fp32["master_bytes"] and master["state_bytes"] == fp32["state_bytes"]
    else:
        assert "bf16_master" not in results  # refused without offload (tested in tests/core/zero)


def test_training_with_bf16_states_follows_the_fp32_master_run(variants: tuple[str, dict[str, Any]]) -> None:
    _, results = variants
    reference = results["fp32_master"]
    for name, result in results.items():
        if name == "bf16_master_resumed":
            continue
        assert len(result["losses"]) == STEPS and all(torch.isfinite(torch.tensor(result["losses"])))
        for key, weight in reference["weights"].items():
            # bf16 rounds each update of a weight of size ~0.1 to ~4e-4; a few steps stay within 1e-2
            torch.testing.assert_close(result["weights"][key], weight, rtol=0, atol=1e-2, msg=f"{name} {key}")
        if name != "fp32_master":
            assert any(not torch.equal(result["weights"][k], w) for k, w in reference["weights"].items()), name


def test_fp32_moments_beside_bf16_master_weights_resume_as_they_were_saved(
    variants: tuple[str, dict[str, Any]],
) -> None:
    offload, results = variants
    if offload == "none":  # bf16 master weights with fp32 moments run with the optimizer offloaded only
        assert "bf16_master_resumed" not in results
        return
    resumed, uninterrupted = results["bf16_master_resumed"], results["bf16_master"]
    assert resumed["state_dtypes"] == ["torch.float32"]
    for key, weight in uninterrupted["weights"].items():
        assert torch.equal(resumed["weights"][key], weight), key
