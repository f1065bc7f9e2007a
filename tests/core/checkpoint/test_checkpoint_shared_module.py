"""A module registered twice in one parent (``body = nn.Sequential(block, nn.Tanh(), block)``, ``block`` also an
attribute): DeepSpeed's checkpoint records ``body.0.*`` as shared but not ``body.2.*``. Every reader of a ZeRO
checkpoint must still find every alias, at every stage and precision: the export equals the live fp32 master weights
and what ZeroExport writes from the live engine (tensors and tie metadata, bit for bit), loads back into one shared
tensor, and fresh-process evaluation loading fills the model with the master weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from checkpoint_fixture import SCRIPT, checkpoint_of  # noqa: E402
from checkpoint_models import SharedBlocks  # noqa: E402
from test_checkpoint_export import read_export  # noqa: E402

from _support.launch import run_torchrun  # noqa: E402
from lightspeed.core.zero.weights import load_zero_weights, read_structure  # noqa: E402
from lightspeed.export import export_checkpoint, load_exported  # noqa: E402

CONFIGS = [
    "shared_s1_none_bf16",
    "shared_s2_none_fp32",
    "shared_s2_cpu_bf16",
    "shared_s3_none_fp32",
    "shared_s3_cpu_bf16",
]
TIED = {
    "body.0.weight": "block.weight",
    "body.0.bias": "block.bias",
    "body.2.weight": "block.weight",
    "body.2.bias": "block.bias",
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zero_shared_module")
    run_torchrun(SCRIPT, 2, [out, *CONFIGS], env={"DS_ACCELERATOR": "cpu"}, timeout=600)
    return out


@pytest.mark.parametrize("config", CONFIGS)
def test_export_finds_every_alias_and_equals_the_live_masters_and_zero_export(root: Path, tmp_path: Path, config: str):
    ckpt, _, reference = checkpoint_of(root, config)
    result = export_checkpoint(ckpt, tmp_path / "out")
    tensors, tied, _ = read_export(tmp_path / "out")
    assert tied == TIED == result.tied
    assert set(tensors) | set(tied) == set(reference["state_dict_keys"])
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, reference["fp32"][name]), name
    live, live_tied, _ = read_export(root / config / "live_export")
    assert live_tied == tied and live.keys() == tensors.keys()
    assert all(torch.equal(live[name], tensors[name]) for name in tensors)
    no_frozen = export_checkpoint(ckpt, tmp_path / "no_frozen", exclude_frozen_parameters=True)
    assert no_frozen.tied == TIED  # nothing of the shared block counts as frozen


@pytest.mark.parametrize("config", CONFIGS)
def test_the_export_loads_back_into_one_shared_tensor(root: Path, tmp_path: Path, config: str):
    ckpt, _, reference = checkpoint_of(root, config)
    export_checkpoint(ckpt, tmp_path / "out")
    torch.manual_seed(123)
    fresh = SharedBlocks()
    assert load_exported(fresh, tmp_path / "out") == ([], [])
    assert fresh.body[0] is fresh.body[2] is fresh.block
    for name, param in fresh.named_parameters():
        assert torch.equal(param, reference["fp32"][name]), name


@pytest.mark.parametrize("config", CONFIGS)
def test_fresh_evaluation_loading_fills_the_model_with_the_masters(root: Path, config: str):
    ckpt, _, reference = checkpoint_of(root, config)
    structure = read_structure(ckpt)
    assert {name: structure.aliases[name] for name in TIED} == TIED
    torch.manual_seed(123)
    fresh = SharedBlocks()
    load_zero_weights(fresh, structure, rank=0)
    for name, param in fresh.named_parameters():
        assert torch.equal(param, reference["fp32"][name]), name
