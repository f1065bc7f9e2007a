"""ZeRO-3 with the optimizer on NVMe gives back the host memory of DeepSpeed's gradient partition once the gradients
are on NVMe, and trains exactly as before: a layer some micro-batches skip, accumulation over 2, AdamW with weight
decay, ``zero3_nvme`` on 2 CPU ranks, against one plain process (<= 1e-5); building the optimizer allocates it
without paging it in."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from _support import model_shapes as ms
from _support.launch import REPO_ROOT, run_torchrun
from _support.process_memory import resident_bytes
from lightspeed.core.zero.swapped_gradients import gradient_partition_allocated_untouched

SCRIPT = REPO_ROOT / "tests" / "core" / "zero" / "scripts" / "swapped_gradients.py"
WIDTH, EPS = ms.WIDE, ms.WIDE_EPS

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages are given back on Linux only")


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out: Path = tmp_path_factory.mktemp("swapped_gradients")
    run_torchrun(SCRIPT, 2, [out], env={"LIGHTSPEED_NVME_PATH": str(out / "nvme")}, timeout=600)
    return torch.load(out / "result.pt")


def test_trains_like_one_process(result: dict[str, Any]) -> None:
    ms.assert_close(
        result["weights"],
        ms.skip_reference(width=WIDTH, eps=EPS),
        "zero3_nvme",
        ms.SometimesSkipped(WIDTH),
        "skippable.weight",
    )


def test_the_gradient_partition_is_not_resident_once_its_gradients_are_on_nvme(result: dict[str, Any]) -> None:
    """Before each step and after the fit (the buffer zeroed for the next window) at most the slots DeepSpeed keeps in
    memory (the biases and the 1-wide head, under 1 % of the buffer) are resident, except a gradient the window's
    closing micro-batch did not reduce (the skippable layer in a window that used it in its first micro-batch only):
    it is not on NVMe yet. DeepSpeed alone keeps the whole buffer resident for the whole run."""
    one_weight = WIDTH * WIDTH * 4 // 2  # a rank's slot of one weight
    for rank, record in enumerate(result["records"]):
        assert record["bytes"] >= 2 * one_weight
        allowed = [one_weight if any(uses) and not uses[-1] else 0 for uses in ms.USES_SKIPPABLE]
        measured = [*record["before_steps"], record["after_fit"]]
        for window, (resident, kept) in enumerate(zip(measured, [*allowed, 0], strict=True)):
            assert kept <= resident <= kept + record["bytes"] // 100, f"rank {rank}, window {window}: {resident}"


def nvme_optimizer_config(fp16: bool = False) -> dict[str, Any]:
    zero = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/unused"}}
    return {"zero_optimization": zero, "fp16": {"enabled": fp16}}


def test_the_optimizer_built_for_nvme_allocates_its_gradient_partition_without_paging_it_in() -> None:
    from deepspeed.runtime.zero import stage3

    with gradient_partition_allocated_untouched(nvme_optimizer_config()):
        large = stage3.torch.zeros(2**22, dtype=torch.float32, device="cpu")  # as DeepSpeed allocates it
        shaped = stage3.torch.zeros(torch.Size([256, 4096]), dtype=torch.bfloat16)
        small = stage3.torch.zeros(3, 5)
        assert stage3.torch.Tensor is torch.Tensor
    assert stage3.torch is torch
    assert resident_bytes(large) == 0 and resident_bytes(shaped) == 0
    assert large.shape == (2**22,) and large.dtype == torch.float32 and torch.count_nonzero(large) == 0
    assert shaped.shape == (256, 4096) and shaped.dtype == torch.bfloat16 and torch.count_nonzero(shaped) == 0
    assert torch.equal(small, torch.zeros(3, 5))


@pytest.mark.parametrize("config", [nvme_optimizer_config(fp16=True), {"zero_optimization": {"stage": 3}}])
def test_other_optimizers_allocate_as_deepspeed_does(config: dict[str, Any]) -> None:
    from deepspeed.runtime.zero import stage3

    with gradient_partition_allocated_untouched(config):
        assert stage3.torch is torch
