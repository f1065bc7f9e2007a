"""LoRA under the Trainer's ZeRO-3 (2 CPU ranks): ``get_peft_model`` on a pretrained Llama built in
``configure_model`` trains like one plain process (zero3, zero3_offload, zero3_nvme; <= 1e-5), only the adapters
train, checkpoints hold the adapters and their optimizer state only and resume exactly, a resume whose frozen base
differs from the saved one is an error, and ``ZeroExport`` / ``lightspeed export`` write PEFT's adapter layout, which
``PeftModel.from_pretrained`` loads, and ``ZeroExport(peft="merged")`` the base model with the adapters folded in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("peft", reason="LoRA needs the peft extra (pip install 'lightspeed[peft]')")

from _support import lora  # noqa: E402
from _support.launch import REPO_ROOT, run_torchrun  # noqa: E402
from lightspeed.core.checkpoint.zero_reader import read_zero_checkpoint  # noqa: E402
from lightspeed.core.errors import ExportError  # noqa: E402
from lightspeed.export import export_checkpoint  # noqa: E402

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_lora.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]], dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("zero_lora")
    lora.write_pretrained(out / "pretrained")
    run_torchrun(SCRIPT, lora.WORLD, [out], timeout=600)
    results = [torch.load(out / f"result_{rank}.pt") for rank in range(lora.WORLD)]
    return out, results, lora.reference(out / "pretrained")


@pytest.mark.parametrize("name", ["zero3", "zero3_offload", "zero3_nvme"])
def test_lora_trains_like_one_process_and_only_the_adapters_move(run: Any, name: str) -> None:
    """The zero3 and zero3_nvme runs were saved at step 2 and resumed to step 4: equal to 4 uninterrupted steps in
    one process."""
    _, results, reference = run
    for rank, result in enumerate(results):
        lora.assert_close(result[name], reference, f"{name} rank {rank}")
    base = lora.lora_model(run[0] / "pretrained").state_dict()
    moved = [key for key in reference if not torch.equal(reference[key], base[key])]
    assert moved and all("lora_" in key for key in moved)  # the adapters trained, the frozen base did not


def test_checkpoints_hold_the_adapters_only(run: Any) -> None:
    out = run[0]
    for folder in ("ck_first", "ck_last"):
        (checkpoint,) = (out / folder).iterdir()
        names = [tensor.name for tensor in read_zero_checkpoint(checkpoint).tensors]
        assert len(names) == 8 and all(".lora_" in name for name in names), names  # 2 layers x q, v x A, B


def test_a_resume_whose_frozen_base_differs_from_the_saved_one_is_an_error_on_every_rank(run: Any) -> None:
    out = run[0]
    (first,) = (out / "ck_first").iterdir()
    expected = (
        f"CheckpointError: Checkpoint {str(first)!r} left the frozen parameters out, and 1 of this model's frozen "
        "parameters differ from those it was saved with (model.base_model.model.model.layers.0.mlp.up_proj.weight): "
        "resuming would continue from other weights. Build the model as the run that saved it did (the same "
        "pretrained files), or save with exclude_frozen_parameters=False."
    )
    assert [result["changed_base"] for result in run[1]] == [expected] * lora.WORLD


def test_a_target_module_the_model_lacks_is_an_error_on_every_rank(run: Any) -> None:
    expected = (
        "AdapterTargetError: The PEFT model at 'model' has adapter 'default' with target_modules ['not_a_layer', "
        "'q_proj'], but ['not_a_layer'] match no module of the model; peft would train the others only. Fix the names "
        "(modules are matched by their name or its last parts, e.g. 'q_proj')."
    )
    assert [result["bad_target"] for result in run[1]] == [expected] * lora.WORLD


@pytest.mark.parametrize("export", ["export_zero3", "export_zero3_offload"])
def test_zero_export_writes_the_adapter_that_peft_loads(run: Any, export: str) -> None:
    out, _, reference = run
    assert sorted(p.name for p in (out / export).iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    lora.assert_close(lora.loaded_adapter(out / "pretrained", out / export), reference, export)


def test_a_merged_export_is_the_base_model_with_the_adapters_folded_in(run: Any) -> None:
    """What peft's ``merge_and_unload()`` gives in one process, loaded by transformers alone."""
    from transformers import AutoModelForCausalLM

    out, _, reference = run
    loaded = AutoModelForCausalLM.from_pretrained(out / "export_merged").state_dict()
    want = lora.merged(out / "pretrained", reference)
    lora.assert_close({key: value.detach() for key, value in loaded.items()}, want, "merged")
    with pytest.raises(ExportError, match="a merged export of a PEFT model is written from the running engine"):
        export_checkpoint(next((out / "ck_last").iterdir()), out / "merged_from_checkpoint", peft="merged")


def test_lightspeed_export_of_the_checkpoint_writes_the_same_adapter(run: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = run[0]
    (last,) = (out / "ck_last").iterdir()
    export_checkpoint(last, tmp_path / "adapter")
    written = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    live = load_file(out / "export_zero3" / "adapter_model.safetensors")
    assert sorted(written) == sorted(live) and all(torch.equal(written[k], live[k]) for k in live)
    assert (tmp_path / "adapter" / "adapter_config.json").read_text() == (
        out / "export_zero3" / "adapter_config.json"
    ).read_text()
    export_checkpoint(last, tmp_path / "full", peft="full")  # the checkpoint's state_dict (adapters only) on request
    full = load_file(tmp_path / "full" / "model.safetensors")
    assert sorted(full) == sorted(tensor.name for tensor in read_zero_checkpoint(last).tensors)
