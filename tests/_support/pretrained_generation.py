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

from lightspeed.core.zero.generation import GRAD_INSIDE_GATHERED_ERROR, SYNCED_GPUS_FALSE_ERROR  # noqa: E402


def single_process_tokens(path: Path) -> list[list[int]]:
    """What each rank's prompt generates on one process, from the same files."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    return [worker.generate(model, rank) for rank in range(len(worker.NEW_TOKENS))]


def run_front_end(out: Path, front_end: str) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """Write the pretrained directories into ``out``, run the worker; its facts and single-process generation."""
    worker.write_pretrained(out / "pretrained")
    worker.write_plain(out)
    run_torchrun(SCRIPTS / "zero_pretrained_generation.py", 2, [out, front_end], timeout=300)
    return json.loads((out / f"{front_end}.json").read_text()), single_process_tokens(out / "pretrained")


def check_built_into_partitions(facts: list[dict[str, Any]]) -> None:
    """``from_pretrained`` (HF model) and ``lightspeed.load_pretrained`` (plain module) filled ZeRO-3 partitions with
    the files' exact weights on every rank."""
    for rank, rank_facts in enumerate(facts):
        for key, tensors in (("built", 10), ("plain", 4)):
            built = rank_facts[key]
            assert built["partitioned"], f"rank {rank}: {key} is not partitioned"
            assert built["local_elements"] == 0  # every parameter is an empty placeholder outside a gather
            assert built["partition_elements"] <= built["full_elements"] // 2 + 64  # this rank's half (and padding)
            assert built["equal_files"] and built["compared"] >= tensors, f"rank {rank}: {key} differs from the files"


def check_bad_pretrained_directory(out: Path, facts: list[dict[str, Any]]) -> None:
    """A directory with another shape, a missing and an extra tensor: one error naming all three, on every rank."""
    source = f"pretrained directory {str(out / 'plain_bad')!r}"
    expected = (
        f"Pretrained directory {str(out / 'plain_bad')!r} does not fit the model; 3 tensor(s):\n"
        f"  0.weight: (37, 14) in {source}, (37, 13) in the model\n"
        f"  2.bias: missing from {source}\n"
        "  3.weight: not in the model\n"
        "Load the weights of this model, or pass strict=False to load the matching tensors only."
    )
    for rank_facts in facts:
        assert rank_facts["plain_bad"] == {"type": "CheckpointError", "message": expected}


def check_generation(facts: list[dict[str, Any]], expected: list[list[int]], keys: tuple[str, ...]) -> None:
    lengths = {len(tokens) for tokens in expected}
    assert len(lengths) == 2  # the ranks really stop at different steps
    for rank, rank_facts in enumerate(facts):
        for key in keys:
            assert rank_facts[key] == expected[rank], f"rank {rank} {key}"
        gathered = rank_facts["gathered"]  # gathered once for the whole generation: same tokens, partitioned after
        before, inside, after = gathered.pop("zero_hooks")
        assert before > 0 and inside == 0 and after == before  # DeepSpeed's module hooks off inside, back after
        assert gathered.pop("collectives_inside") == []  # no per-token flag all-reduce, no gather
        assert gathered.pop("with_grad") == {"type": "RuntimeError", "message": GRAD_INSIDE_GATHERED_ERROR}
        assert gathered == {"tokens": expected[rank], "gathered": True, "partitioned_after": True}
        assert rank_facts["synced_gpus_false"] == {
            "type": "ValueError",
            "message": SYNCED_GPUS_FALSE_ERROR.format(world=2),
        }
