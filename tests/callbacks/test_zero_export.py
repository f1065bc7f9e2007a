"""ZeroExport end to end: 2 CPU ranks fit with lightspeed's ZeRO strategies (zero3_offload, zero2 in bf16 export
with sharding and per-checkpoint export, zero3_nvme with a layer big enough to be swapped), one launch for all.

The export written from the live sharded model must equal the fp32 master weights gathered after fit, equal the
offline export of the checkpoint ModelCheckpoint saved at the same step bit for bit, and load into a fresh module.
The last case is the README's model (examples/tiny_lm.py: a small transformer LM with a tied head).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from _support.launch import run_python, run_torchrun
from _support.trainers import quiet_trainer
from lightspeed.errors import ExportError
from lightspeed.export import export_checkpoint, load_exported

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE / "scripts"))
sys.path.insert(0, str(REPO / "tests" / "core" / "checkpoint" / "scripts"))
sys.path.insert(0, str(REPO / "examples"))
from zero_export_fit import CASES, CUDA_CASES, HF_CASES, HF_GPT2, LitLM  # noqa: E402

CASE_NAMES = list(CASES)
HF_CASE = "zero3_offload_hf_gpt2"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zero_export")
    run_torchrun(
        HERE / "scripts" / "zero_export_fit.py",
        2,
        [out, *CASE_NAMES, *HF_CASES],
        env={"DS_ACCELERATOR": "cpu"},
        timeout=600,
    )
    return out


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    tensors, tied = {}, {}
    files = sorted(p.name for p in path.iterdir())
    for name in files:
        if name.endswith(".safetensors"):
            with safe_open(str(path / name), framework="pt") as handle:
                tied = json.loads(handle.metadata()["lightspeed_tied"])
                tensors.update({k: handle.get_tensor(k) for k in handle.keys()})
    return tensors, tied, files


@pytest.mark.parametrize("case", CASE_NAMES)
def test_export_equals_live_weights_and_checkpoint_export(runs, tmp_path, case):
    root = runs / case
    reference = torch.load(root / "reference.pt", weights_only=False)
    dtype = torch.bfloat16 if CASES[case][2]["dtype"] == "bf16" else torch.float32
    live, tied, files = read(root / "export")
    assert set(live) | set(tied) == set(reference["keys"])
    assert tied == {"net.head.weight": ("net.tokens.weight" if case == "zero3_tiny_gpt" else "net.embed.weight")}
    for name, tensor in live.items():
        expected = reference["buffers"][name] if name in reference["buffers"] else reference["fp32"][name]
        if expected.is_floating_point():
            assert tensor.dtype == dtype and torch.equal(tensor, expected.to(dtype)), name
        else:
            assert torch.equal(tensor, expected), name
    if "max_shard_size" in CASES[case][2]:
        assert "model.safetensors.index.json" in files and len(files) > 2
    # on_checkpoint: one export per checkpoint save (epoch-end and last.ckpt) and the final one at the end of fit
    assert reference["export_count"] == (3 if CASES[case][2].get("on_checkpoint") else 1)

    # the checkpoint saved at the same step exports to exactly the same tensors
    offline_dir = tmp_path / "offline"
    export_checkpoint(root / "ckpts" / "last.ckpt", offline_dir, dtype=CASES[case][2]["dtype"])
    offline, offline_tied, _ = read(offline_dir)
    assert offline_tied == tied and offline.keys() == live.keys()
    assert all(torch.equal(offline[k], live[k]) and offline[k].dtype == live[k].dtype for k in live)

    fresh = LitLM(CASES[case][1])
    assert load_exported(fresh, root / "export") == ([], [])
    for name, value in fresh.state_dict().items():
        owner = tied.get(name, name)
        assert torch.equal(value, live[owner].to(value.dtype)), name


def test_refuses_non_deepspeed_strategy_and_occupied_directory(tmp_path):

    from lightspeed.callbacks import ZeroExport

    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
    )
    callback = ZeroExport(tmp_path / "export")
    with pytest.raises(
        ExportError,
        match=r"ZeroExport needs a DeepSpeed strategy .* the trainer uses "
        r"SingleDeviceStrategy",
    ):
        callback.setup(trainer, LitLM("tiny"), "fit")
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "model.safetensors").write_text("from another run")
    zero = quiet_trainer(
        strategy="zero2",
        accelerator="cpu",
        devices=1,
        max_steps=1,
    )
    with pytest.raises(ExportError, match=r"output directory .*occupied exists and is not empty; pass overwrite=True"):
        ZeroExport(occupied).setup(zero, LitLM("tiny"), "fit")  # before training starts, not after
    ZeroExport(occupied, overwrite=True).setup(zero, LitLM("tiny"), "fit")
    with pytest.raises(ExportError, match=r"unsupported export dtype 'float8'"):
        ZeroExport(tmp_path / "export", dtype="float8")


def test_every_rank_raises_when_rank_zero_fails(runs):
    """Rank 0 failing mid-export (write error) or in the setup check (the first fit's export is in the way) makes
    every rank raise, and a collective afterwards completes: no rank is left waiting for rank 0."""
    reference = torch.load(runs / "zero3_offload" / "reference.pt", weights_only=False)
    rank0, rank1 = reference["failures"]
    assert rank0["failed_write"] == "OSError: disk full"
    assert rank1["failed_write"].startswith("ExportError: rank 0 could not write the export to ")
    assert rank1["failed_write"].endswith("broken_export (OSError: disk full)")
    assert not rank0["broken_export_exists"]  # the staging directory was removed, nothing appeared
    for outcome in (rank0, rank1):  # a second fit must not replace the first fit's export (overwrite=False)
        assert outcome["second_fit"].startswith("ExportError: output directory ")
        assert "exists and is not empty; pass overwrite=True" in outcome["second_fit"]


def _hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(directory)
    assert not model.training
    with torch.no_grad():
        return model(input_ids=tokens).logits


def test_hf_model_export_loads_with_from_pretrained(runs):
    """ZeroExport(strip_prefix="model.") of a GPT-2 trained under zero3_offload writes config.json and
    generation_config.json beside the weights: from_pretrained(export) gives the trained model's logits."""
    from transformers import GenerationConfig, GPT2Config

    root = runs / HF_CASE
    export = root / "export"
    assert sorted(p.name for p in export.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    config = json.loads((export / "config.json").read_text())
    assert {key: config[key] for key in HF_GPT2} == HF_GPT2
    expected_generation = GenerationConfig.from_model_config(GPT2Config(**HF_GPT2)).to_dict()
    assert GenerationConfig.from_pretrained(export).to_dict() == expected_generation
    reference = torch.load(root / "reference.pt")
    logits = _hf_logits(export, reference["tokens"])
    assert logits.shape == (2, 13, HF_GPT2["vocab_size"])
    assert (logits - reference["logits"]).abs().max().item() <= 1e-6


def test_offline_export_of_the_hf_checkpoint_with_hf_config(runs, tmp_path):
    """The checkpoint of the same run, exported by the library call (config object) and by `lightspeed export
    --hf-config` (the directory save_pretrained wrote), loads with from_pretrained to the same logits."""
    from transformers import GPT2Config

    from lightspeed.cli.main import main

    root = runs / HF_CASE
    reference = torch.load(root / "reference.pt")
    checkpoint = root / "ckpts" / "last.ckpt"
    result = export_checkpoint(checkpoint, tmp_path / "library", strip_prefix="model.", hf_config=GPT2Config(**HF_GPT2))
    assert result.files == ["model.safetensors", "config.json"]
    assert (_hf_logits(tmp_path / "library", reference["tokens"]) - reference["logits"]).abs().max().item() <= 1e-6

    GPT2Config(**HF_GPT2).save_pretrained(tmp_path / "saved")
    argv = ["export", str(checkpoint), str(tmp_path / "cli"), "--strip-prefix", "model."]
    assert main([*argv, "--hf-config", str(tmp_path / "saved"), "--quiet"]) == 0
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == ["config.json", "model.safetensors"]
    assert (_hf_logits(tmp_path / "cli", reference["tokens"]) - reference["logits"]).abs().max().item() <= 1e-6


@pytest.fixture(scope="module")
def cuda_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zero_export_cuda")
    run_torchrun(HERE / "scripts" / "zero_export_fit.py", 1, [out, *CUDA_CASES], timeout=600)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_export_of_a_cuda_trained_checkpoint_loads_on_the_cpu(cuda_runs, tmp_path, case):
    """Trained on a GPU (bf16 ZeRO-3; fp16 ZeRO-2 with CPU offload), exported live by ZeroExport; the checkpoint then
    exported offline and loaded by a process that sees no GPU: both exports equal the fp32 masters, bit for bit."""
    root = cuda_runs / case
    reference = torch.load(root / "reference.pt", weights_only=False)
    live, tied, _ = read(root / "export")
    for name, tensor in live.items():
        expected = reference["buffers"][name] if name in reference["buffers"] else reference["fp32"][name]
        assert tensor.device.type == "cpu" and torch.equal(tensor, expected.to(tensor.dtype)), name

    offline_dir, result = tmp_path / "offline", tmp_path / "loaded.pt"
    dtype = CUDA_CASES[case][1]["dtype"]
    run_python(
        HERE / "scripts" / "export_on_cpu.py",
        [root / "ckpts" / "last.ckpt", offline_dir, dtype, result],
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    loaded = torch.load(result, weights_only=False)
    assert loaded["cuda_available"] is False and loaded["load"] == ([], [])
    offline, offline_tied, _ = read(offline_dir)
    assert offline_tied == tied and offline.keys() == live.keys()
    assert all(torch.equal(offline[k], live[k]) for k in live)
    for name, value in loaded["state"].items():
        assert torch.equal(value, live[tied.get(name, name)].to(value.dtype)), name
