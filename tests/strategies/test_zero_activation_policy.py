"""``activation_checkpointing_policy={Block}`` under the Trainer (2 CPU ranks, fp32, ZeRO-1/2/3): the weights after 3
steps equal the run without it, every block's forward ran twice per step (again in the backward pass) under
``deepspeed.checkpointing.checkpoint``, and DeepSpeed's checkpointing was configured with the whole resolved
section. The arguments reach the config through ``ZeroStrategy`` and ``zero_auto``."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

import lightspeed
from _support.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_activation_policy.py"
sys.path.insert(0, str(SCRIPT.parent))
import zero_activation_policy as worker  # noqa: E402

STAGES = [1, 2, 3]
RESOLVED_SECTION = {
    "partition_activations": False,
    "cpu_checkpointing": False,  # the CPU device: the checkpoints are in host memory already
    "contiguous_memory_optimization": False,
    "synchronize_checkpoint_boundary": True,
    "profile": False,
    "number_checkpoints": worker.BLOCKS,
}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("zero_activation_policy")
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
    assert (policy["blocks.0.fc.weight"] - first).abs().max() > 1e-3  # the first block (input without grad) trained
    blocks_per_rank = worker.STEPS * worker.BLOCKS
    for rank_facts in result["facts"][f"zero{stage}.plain"]:
        assert (rank_facts["forward"], rank_facts["checkpoint"], rank_facts["section"]) == (blocks_per_rank, 0, None)
    for rank_facts in result["facts"][f"zero{stage}.policy"]:
        assert rank_facts["forward"] == 2 * blocks_per_rank  # and again in the backward pass
        assert rank_facts["checkpoint"] == blocks_per_rank
        assert rank_facts["section"] == RESOLVED_SECTION
        # configured with every key (Lightning's own call would reset synchronize and number_checkpoints)
        assert rank_facts["deepspeed"] == {"synchronize": True, "num_layers": worker.BLOCKS, "cpu": False}


def test_the_strategies_pass_the_arguments_through() -> None:
    strategy = lightspeed.strategies.ZeroStrategy(
        stage=3, offload_parameters="cpu", activation_checkpointing_policy={worker.Block}, profile=True
    )
    assert strategy.activation_checkpointing_policy == frozenset({worker.Block})
    assert strategy.config["activation_checkpointing"]["profile"] is True
    auto = lightspeed.strategies.ZeroAutoStrategy(
        activation_checkpointing_policy=[worker.Block], cpu_checkpointing=True
    )
    assert auto.activation_checkpointing_policy == frozenset({worker.Block})
    assert auto.request.tuning.cpu_checkpointing is True
    with pytest.raises(lightspeed.errors.DeepSpeedConfigError, match="activation_checkpointing_policy must be a set"):
        lightspeed.strategies.ZeroStrategy(activation_checkpointing_policy="Block")
