"""Generate the ZeRO checkpoints of the export tests once per test session (one torchrun launch, 2 ranks).

Several test modules (core, cli) need the same checkpoints; :func:`zero_checkpoints` memoises the directory per
pytest session so the ~70 s launch happens once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from _support.launch import run_torchrun

SCRIPT = Path(__file__).resolve().parent / "checkpoint_make_zero.py"
# stages 0-3 x {none, cpu, nvme}. DeepSpeed accepts optimizer offload with stage 0 but ignores it (same files as
# without); stages 1/2 accept "nvme" but keep their optimizer on the CPU; only stage 3 swaps to NVMe, and only
# sub-groups of >= 1 MB per rank, hence the big layer in s3_nvme_fp32_big
MATRIX = [
    "s0_none_fp32",
    "s0_cpu_fp32",
    "s0_nvme_fp32",
    "s0_none_bf16",
    "s1_none_fp32",
    "s1_cpu_fp32",
    "s1_nvme_fp32",
    "s2_none_fp32",
    "s2_cpu_fp32",
    "s2_nvme_fp32",
    "s3_none_fp32",
    "s3_cpu_fp32",
    "s3_nvme_fp32_big",
    "s3_cpu_bf16",
]
LIGHTNING = ["lit_s3_cpu_fp32", "litwrap_s2_none_fp32"]
HF = "hf_s3_none_fp32"
MIXED = "mix_s2_none_fp32"  # saved at step 2 and step 3 (tags step2, step3) for the mixed-files errors
ALL = MATRIX + LIGHTNING + [HF, MIXED]

_CACHE: dict[str, Path] = {}
# developers iterating on the exporter can point this at a directory a previous session generated
REUSE_ENV = "LIGHTSPEED_TEST_REUSE_ZERO_CHECKPOINTS"


def zero_checkpoints(tmp_path_factory) -> Path:
    """Directory with one sub-directory per config (checkpoint, reference.pt, info.json)."""
    reuse = os.environ.get(REUSE_ENV)
    if reuse and all((Path(reuse) / config / "info.json").is_file() for config in ALL):
        return Path(reuse)
    key = str(tmp_path_factory.getbasetemp())
    if key not in _CACHE:
        out = tmp_path_factory.mktemp("zero_checkpoints")
        run_torchrun(SCRIPT, 2, [out, *ALL], env={"DS_ACCELERATOR": "cpu"}, timeout=600)
        _CACHE[key] = out
    return _CACHE[key]


def checkpoint_of(root: Path, config: str) -> tuple[Path, str, dict]:
    """(checkpoint directory, tag, reference) of one generated config."""
    info = json.loads((root / config / "info.json").read_text())
    reference = torch.load(root / config / "reference.pt", weights_only=False)
    return root / config / info["checkpoint"], info["tag"], reference
