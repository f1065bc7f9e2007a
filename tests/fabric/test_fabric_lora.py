"""LoRA under Fabric's ZeRO-3 strategies (zero3, zero3_offload, zero3_nvme; 2 CPU ranks): ``get_peft_model`` on a
pretrained Llama built under ``fabric.init_module()`` trains like one plain process (<= 1e-5) through a
``fabric.save`` / ``fabric.load`` in the middle; the checkpoints hold the adapters only, and ``lightspeed export``
writes the adapter ``PeftModel.from_pretrained`` loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft", reason="LoRA needs the peft extra (pip install 'lightspeed[peft]')")

from _support import lora  # noqa: E402
from _support.launch import REPO_ROOT, run_torchrun  # noqa: E402
from lightspeed.core.checkpoint.zero_reader import read_zero_checkpoint  # noqa: E402
from lightspeed.export import export_checkpoint  # noqa: E402

SCRIPT = REPO_ROOT / "tests" / "fabric" / "scripts" / "zero_lora.py"


@pytest.mark.parametrize("strategy", ["zero3", "zero3_offload", "zero3_nvme"])
def test_lora_under_fabric_resumes_exactly_and_exports_the_adapter(tmp_path: Path, strategy: str) -> None:
    lora.write_pretrained(tmp_path / "pretrained")
    nvme = {"LIGHTSPEED_NVME_PATH": str(tmp_path / "nvme")}
    run_torchrun(SCRIPT, lora.WORLD, [tmp_path, strategy], env=nvme, timeout=600)
    results = [torch.load(tmp_path / f"result_{rank}.pt")[strategy] for rank in range(lora.WORLD)]
    reference = lora.reference(tmp_path / "pretrained")
    for rank, result in enumerate(results):
        lora.assert_close(result, reference, f"{strategy}, rank {rank}")
    for folder in ("ck_first", "ck_last"):
        names = [tensor.name for tensor in read_zero_checkpoint(tmp_path / folder).tensors]
        assert len(names) == 8 and all(".lora_" in name for name in names), names
    export_checkpoint(tmp_path / "ck_last", tmp_path / "adapter")
    lora.assert_close(lora.loaded_adapter(tmp_path / "pretrained", tmp_path / "adapter"), reference, "export")
