"""Several models with their parameters on NVMe in one process (2 CPU ranks): each model's parameter swapper swaps
into a folder of its own (DeepSpeed's empties a shared folder whenever one is made, so a second model deleted the
first one's parameters and the first one's next forward failed reading them): under Fabric a model set up after
another leaves the first one's forward unchanged, and both train as they do with the parameters on the CPU. A
released engine's optimizer swap files are deleted, and a parameter's file when the parameter is freed (a process
building engine after engine, such as the tuner's trials, would fill the disk with them)."""

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


def test_a_released_engines_swap_files_are_deleted_and_a_parameters_file_goes_with_it(result: dict[str, Any]) -> None:
    held = result["first_files"]
    assert held["optimizer"] > 0 and held["parameters"] > 0 and result["first_on_disk"] == held
    # released: its optimizer's files go; its parameters' stay while the model lives (it may train again)
    assert result["first_on_disk_after_release"] == {"optimizer": 0, "parameters": held["parameters"]}
    assert result["first_on_disk_once_freed"] == {"optimizer": 0, "parameters": 0}
    assert result["second_on_disk"] == held  # the same model again: as many files, all there
    assert result["same_model_again"] == "no error"  # a released engine's model trains again under a new one
