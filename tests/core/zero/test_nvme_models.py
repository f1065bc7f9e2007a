"""Several models with their parameters on NVMe in one process (2 CPU ranks): each model's parameter swapper swaps
into a folder of its own (DeepSpeed's empties a shared folder whenever one is made, so a second model deleted the
first one's parameters and the first one's next forward failed reading them): under Fabric a model set up after
another leaves the first one's forward unchanged, and both train as they do with the parameters on the CPU. A
released engine's swap files are deleted (a process building engine after engine, such as the tuner's trials, would
fill the disk with them)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _support.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "core" / "zero" / "scripts" / "nvme_models.py"


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("nvme_models")
    run_torchrun(SCRIPT, 2, [out], env={"LIGHTSPEED_NVME_PATH": str(out / "nvme")}, timeout=600)
    return torch.load(out / "result.pt")


def test_a_second_model_on_nvme_leaves_the_first_ones_parameters_in_place(result: dict[str, Any]) -> None:
    nvme, cpu = result["zero3_nvme"], result["zero3_offload"]
    assert nvme["same_forward"] and cpu["same_forward"]
    for model in ("a", "b"):
        assert nvme[model].keys() == cpu[model].keys()
        for key, value in cpu[model].items():
            assert torch.equal(nvme[model][key], value), f"model {model}: {key}"


def test_a_released_engines_swap_files_are_deleted(result: dict[str, Any]) -> None:
    assert result["first_files"] > 0 and result["first_files_on_disk"] == result["first_files"]
    assert result["first_files_left"] == []
    assert result["second_files_on_disk"] == result["first_files"]  # the same model: as many files, all there
