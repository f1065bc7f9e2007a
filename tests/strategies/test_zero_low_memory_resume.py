"""Resuming runs with DeepSpeed's low-memory bf16 states under the Trainer (2 CPU ranks, bf16-mixed): with bf16 master
weights and fp32 moments (DeepSpeed's CPU Adam, ZeRO-2 and ZeRO-3 with the optimizer offloaded) torch's
``load_state_dict`` rounded the moments to bf16 and the resumed run drifted (9.8e-4 after three steps); now every
variant's resume ends with the uninterrupted run's weights bit for bit. A resharded resume of such a run, which
DeepSpeed's universal load would round the same way, is refused on every rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from _support.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_low_memory_resume.py"
VARIANTS = ["zero2_offload_master", "zero3_offload_master", "zero3_master_and_states"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], list[dict[str, str]]]:
    out = tmp_path_factory.mktemp("low_memory_resume")
    run_torchrun(SCRIPT, 2, [out], timeout=600)
    errors = [json.loads((out / f"errors_{rank}.json").read_text()) for rank in (0, 1)]
    return out, torch.load(out / "weights.pt"), errors


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_resume_with_low_memory_states_ends_with_the_uninterrupted_weights(runs: Any, variant: str) -> None:
    full, resumed = runs[1][variant]
    assert full.keys() == resumed.keys()
    for key, value in full.items():
        assert torch.equal(resumed[key], value), f"{key} differs by {(resumed[key] - value).abs().max()}"


def test_a_resharded_resume_that_would_round_the_moments_is_refused_on_every_rank(runs: Any) -> None:
    out, _, errors = runs
    expected = (
        f"CheckpointError: Resuming from {str(out / 'four.ckpt')!r}: the checkpoint was written by 4 processes and "
        "this run has 2, with half-precision master weights and fp32 optimizer moments (bf16_master_weights_and_grads "
        "without bf16_optimizer_states), which DeepSpeed's resharded load rounds to the master weights' precision. "
        "Resume on 4 processes, or export its weights (`lightspeed export`) and start a new run from them."
    )
    assert [error["resharded"] for error in errors] == [expected] * 2
