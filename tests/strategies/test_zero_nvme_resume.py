"""Resuming with the optimizer states or the parameters on NVMe under the Trainer (2 CPU ranks, a layer whose
partition the optimizer swapper keeps on NVMe beside ones it keeps in memory, AdamW with a per-step schedule): a new
Trainer resuming a ``zero3_nvme`` checkpoint ends with the uninterrupted run's weights bit for bit, and both equal
one plain process; so does a resume through the engine's own ``load_checkpoint`` into an engine that has stepped
(what node-local and several-model resumes call), and one with the parameters on NVMe and the optimizer on the CPU
(DeepSpeed's own restore fails there). What cannot resume exactly is refused with one error on every rank: an NVMe
checkpoint resumed without the optimizer on NVMe or the other way round, a swap file cut short, another number of
processes. Fabric's NVMe resume is tested in tests/fabric/test_fabric_lora.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from _support.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_nvme_resume.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], list[dict[str, str]]]:
    out = tmp_path_factory.mktemp("nvme_resume")
    run_torchrun(SCRIPT, 2, [out], env={"LIGHTSPEED_NVME_PATH": str(out / "nvme")}, timeout=600)
    errors = [json.loads((out / f"errors_{rank}.json").read_text()) for rank in (0, 1)]
    return out, torch.load(out / "weights.pt"), errors


@pytest.mark.parametrize("run", ["resumed", "engine_direct", "params_on_nvme"])
def test_a_resume_with_something_on_nvme_ends_with_the_uninterrupted_weights(runs: Any, run: str) -> None:
    _, weights, _ = runs
    full = weights["full"]
    assert full.keys() == weights[run].keys() == weights["plain"].keys()
    for key, value in full.items():
        off = (weights[run][key] - value).abs().max()
        assert torch.equal(weights[run][key], value), f"{run}: {key} differs from the uninterrupted run's by {off}"
        scale = weights["plain"][key].abs().max()
        assert (value - weights["plain"][key]).abs().max() <= 1e-5 * scale, f"{key}: not one plain process's"


def test_what_cannot_resume_exactly_is_refused_on_every_rank(runs: Any) -> None:
    out, _, errors = runs
    ck = out / "ck"
    assert errors[0] == errors[1]
    start = "CheckpointError: Resuming from "
    export = "export its weights (`lightspeed export`) and start a new run from them."
    short = ck / "short.ckpt" / "checkpoint" / "offloaded_tensors" / "rank01"
    (short_file,) = short.glob("exp_avg-*.tensor.swp")
    assert errors[0] == {
        "nvme_into_offload": (
            f"{start}{str(ck / 'nvme.ckpt')!r}: the checkpoint was saved with the optimizer states on NVMe "
            "(zero3_nvme), and this run keeps them elsewhere, where DeepSpeed would read the empty placeholders the "
            "NVMe save left in the ZeRO shards. Resume with the optimizer states on NVMe as the run that saved it "
            f"did, or {export}"
        ),
        "offload_into_nvme": (
            f"{start}{str(ck / 'offload.ckpt')!r}: this run keeps the optimizer states on NVMe (zero3_nvme), and the "
            "checkpoint was saved with them in memory or on the CPU, so it has no swap files to resume them from. "
            f"Resume with the offload it was saved with, or {export}"
        ),
        "short_swap_file": (
            f"CheckpointError: {short_file} has {short_file.stat().st_size} bytes: it holds this rank's part of "
            f"sub-group 2 ({short_file.stat().st_size + 4096} bytes), which the checkpoint saved on NVMe. Copy the "
            "checkpoint again, whole, or resume from an earlier one."
        ),
        "four_processes": (
            f"{start}{str(ck / 'four.ckpt')!r}: the checkpoint was written by 4 processes and this run has 2, with "
            "its optimizer states or parameters on NVMe, where DeepSpeed cannot load a resharded checkpoint (and an "
            f"NVMe save's swap files hold each rank's own partition). Resume on 4 processes, or {export}"
        ),
    }
