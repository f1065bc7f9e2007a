"""``activation_checkpointing_policy={Block}`` under Fabric (2 CPU ranks, fp32, ZeRO-1/2/3), as the Trainer's test
checks it (tests/strategies/test_zero_activation_policy.py): same weights as without it, every block's forward twice
per step under ``deepspeed.checkpointing.checkpoint``, DeepSpeed configured with the whole resolved section."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

import lightspeed
from _support.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "fabric" / "scripts" / "fabric_activation_policy.py"
sys.path.insert(0, str(REPO_ROOT / "tests" / "strategies" / "scripts"))
import zero_activation_policy as worker  # noqa: E402  (the model and data both workers train)

STAGES = [1, 2, 3]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fabric_activation_policy")
    run_torchrun(SCRIPT, 2, [out, ",".join(map(str, STAGES))], timeout=600)
    return torch.load(out / "result.pt")


@pytest.mark.parametrize("stage", STAGES)
def test_the_policy_checkpoints_every_block_and_trains_like_without_it(result: dict[str, Any], stage: int) -> None:
    plain, policy = result["weights"][f"zero{stage}.plain"], result["weights"][f"zero{stage}.policy"]
    assert plain.keys() == policy.keys() and plain
    for key in plain:
        diff = (plain[key] - policy[key]).abs().max().item()
        assert diff <= 1e-5, f"zero{stage} {key}: checkpointing changed the weights by {diff:.3e}"
    first = worker.initial_weights()["blocks.0.fc.weight"]
    assert (policy["blocks.0.fc.weight"] - first).abs().max() > 1e-3
    blocks_per_rank = worker.STEPS * worker.BLOCKS
    for rank_facts in result["facts"][f"zero{stage}.plain"]:
        assert (rank_facts["forward"], rank_facts["checkpoint"], rank_facts["section"]) == (blocks_per_rank, 0, None)
    for rank_facts in result["facts"][f"zero{stage}.policy"]:
        assert rank_facts["forward"] == 2 * blocks_per_rank
        assert rank_facts["checkpoint"] == blocks_per_rank
        assert rank_facts["section"] == {
            "partition_activations": False,
            "cpu_checkpointing": False,
            "contiguous_memory_optimization": False,
            "synchronize_checkpoint_boundary": True,
            "profile": False,
            "number_checkpoints": worker.BLOCKS,
        }
        assert rank_facts["deepspeed"] == {"synchronize": True, "num_layers": worker.BLOCKS, "cpu": False}


def test_the_fabric_strategies_take_the_section_keywords_they_used_to_refuse() -> None:
    strategy = lightspeed.fabric.ZeroFabricStrategy(
        stage=2, partition_activations=True, cpu_checkpointing=False, synchronize_checkpoint_boundary=True
    )
    assert strategy.config["activation_checkpointing"] == {
        "partition_activations": True,
        "cpu_checkpointing": False,
        "contiguous_memory_optimization": "auto",
        "synchronize_checkpoint_boundary": True,
        "profile": False,
    }
    assert strategy.activation_checkpointing_policy is None
    auto = lightspeed.fabric.ZeroAutoFabricStrategy(activation_checkpointing_policy=worker.Block, profile=True)
    assert auto.activation_checkpointing_policy == frozenset({worker.Block})
    assert auto.request.tuning.profile is True
    with pytest.raises(TypeError, match="`partition_activation`: not a keyword of ZeroFabricStrategy"):
        lightspeed.fabric.ZeroFabricStrategy(partition_activation=True)
