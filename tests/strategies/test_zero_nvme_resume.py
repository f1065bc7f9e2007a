"""Resuming a ``zero3_nvme`` run is refused under the Trainer, on every rank, before anything is loaded: DeepSpeed
0.19 does not restore NVMe-swapped optimizer states exactly (a resumed full fine-tune ended 0.15 off the uninterrupted
run), and a resume that silently continues from other states is worse than none. Fabric's refusal is tested in
tests/fabric/test_fabric_lora.py."""

from __future__ import annotations

import json
from pathlib import Path

from _support.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_nvme_resume.py"


def test_resuming_with_the_optimizer_on_nvme_is_refused_on_every_rank(tmp_path: Path) -> None:
    run_torchrun(SCRIPT, 2, [tmp_path], env={"LIGHTSPEED_NVME_PATH": str(tmp_path / "nvme")}, timeout=600)
    expected = (
        f"CheckpointError: Resuming from {str(tmp_path / 'mid.ckpt')!r} with the optimizer states on NVMe "
        "(zero3_nvme): DeepSpeed does not restore NVMe-swapped optimizer states exactly, so lightspeed refuses rather "
        "than continue from other states. The checkpoint itself is complete: export its weights (`lightspeed export`) "
        "to evaluate them or to start a new run from them; to resume runs exactly, train with the optimizer states in "
        "memory or on the CPU (zero3, zero3_offload)."
    )
    # the engine itself refuses (node-local and several-model resumes call it), and the Trainer's resume
    assert [json.loads((tmp_path / f"result_{rank}.json").read_text()) for rank in (0, 1)] == [[expected] * 2] * 2
