"""The pretrained-model and generation scenario under ZeRO-3, shared by the Trainer's and Fabric's tests: launch the
worker (``tests/strategies/scripts/zero_pretrained_generation.py``) on 2 ranks and check what it reports against
single-process generation from the same files."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from _support.launch import REPO_ROOT, run_torchrun

SCRIPTS = REPO_ROOT / "tests" / "strategies" / "scripts"
sys.path.insert(0, str(SCRIPTS))
import zero_pretrained_generation as worker  # noqa: E402

from lightspeed.core.zero.generation import SYNCED_GPUS_FALSE_ERROR  # noqa: E402


def single_process_tokens(path: Path) -> list[list[int]]:
    """What each rank's prompt generates on one process, from the same files."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    return [worker.generate(model, rank) for rank in range(len(worker.NEW_TOKENS))]


def run_front_end(out: Path, front_end: str) -> tuple[list[dict[str, Any]], list[list[int]]]:
    worker.write_pretrained(out / "pretrained")
    run_torchrun(SCRIPTS / "zero_pretrained_generation.py", 2, [out, front_end], timeout=300)
    return json.loads((out / f"{front_end}.json").read_text()), single_process_tokens(out / "pretrained")


def check_built_into_partitions(facts: list[dict[str, Any]]) -> None:
    for rank, rank_facts in enumerate(facts):
        built = rank_facts["built"]
        assert built["partitioned"], f"rank {rank}: from_pretrained built an unpartitioned model"
        assert built["local_elements"] == 0  # every parameter is an empty placeholder outside a gather
        assert built["partition_elements"] <= built["full_elements"] // 2 + 64  # this rank's half (and padding)
        assert built["equal_files"] and built["compared"] > 10, f"rank {rank}: weights differ from the files"


def check_generation(facts: list[dict[str, Any]], expected: list[list[int]], keys: tuple[str, ...]) -> None:
    lengths = {len(tokens) for tokens in expected}
    assert len(lengths) == 2  # the ranks really stop at different steps
    for rank, rank_facts in enumerate(facts):
        for key in keys:
            assert rank_facts[key] == expected[rank], f"rank {rank} {key}"
        assert rank_facts["synced_gpus_false"] == {
            "type": "ValueError",
            "message": SYNCED_GPUS_FALSE_ERROR.format(world=2),
        }
