"""Exporting real DeepSpeed ZeRO checkpoints (2 and 3 CPU ranks, gloo) to safetensors.

The checkpoints come from plain DeepSpeed engines trained for two steps
(tests/core/checkpoint/scripts/checkpoint_make_zero.py):
stages 0-3 x {no offload, CPU offload, NVMe offload into a temporary directory}, fp32 and bf16, with a tied
embedding/head, a frozen layer, odd sizes that force padding, two parameter groups and buffers. The reference is
what the live engines held after training: the fp32 master weights (``safe_get_full_fp32_param``), the gathered
module weights and the buffers. Each export must equal it bit for bit, equal DeepSpeed's own converter where that
works, and load back into a fresh module.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from checkpoint_fixture import LIGHTNING, MATRIX, SCRIPT, checkpoint_of, zero_checkpoints  # noqa: E402
from checkpoint_models import TinyLM  # noqa: E402

from _support.launch import run_torchrun  # noqa: E402
from lightspeed.errors import ExportError  # noqa: E402
from lightspeed.export import export_checkpoint, load_exported  # noqa: E402

THREE_RANKS = ["s1_none_fp32", "s2_cpu_fp32", "s3_nvme_fp32_big"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return zero_checkpoints(tmp_path_factory)


@pytest.fixture(scope="module")
def root3(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zero_checkpoints_3ranks")
    run_torchrun(SCRIPT, 3, [out, *THREE_RANKS], env={"DS_ACCELERATOR": "cpu"}, timeout=600)
    return out


def read_export(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    files = sorted(p.name for p in path.iterdir())
    tensors, tied = {}, {}
    for name in files:
        if name.endswith(".safetensors"):
            with safe_open(str(path / name), framework="pt") as handle:
                tied = json.loads(handle.metadata()["lightspeed_tied"])
                assert handle.metadata()["format"] == "pt"
                for key in handle.keys():
                    tensors[key] = handle.get_tensor(key)
    return tensors, tied, files


def expected(reference: dict, name: str) -> torch.Tensor:
    """The live value: buffers as they are, frozen weights as trained (training dtype), others fp32 masters."""
    if name in reference["buffers"]:
        return reference["buffers"][name]
    if name in reference["frozen"]:
        return reference["module"][name]
    return reference["fp32"][name]


def assert_matches_live(
    tensors: dict[str, torch.Tensor], reference: dict, dtype: torch.dtype = torch.float32, rename=lambda n: n
) -> None:
    for name, tensor in tensors.items():
        live = expected(reference, rename(name))
        if live.is_floating_point():
            assert tensor.dtype == dtype, name
            assert torch.equal(tensor, live.to(dtype)), name
        else:
            assert tensor.dtype == live.dtype and torch.equal(tensor, live), name


@pytest.mark.parametrize("config", MATRIX)
def test_export_equals_live_weights(root, tmp_path, config):
    ckpt, tag, reference = checkpoint_of(root, config)
    result = export_checkpoint(ckpt, tmp_path / "out", max_shard_size="4KB")
    tensors, tied, files = read_export(tmp_path / "out")

    assert "model.safetensors.index.json" in files and len(files) > 2  # sharded, HF names
    assert files[0] == f"model-00001-of-{len(files) - 1:05d}.safetensors"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    # every key of the module's state_dict, the tied head written once
    assert tied == {"head.weight": "embed.weight"} == result.tied
    assert set(tensors) | set(tied) == set(reference["state_dict_keys"])
    assert "head.weight" not in tensors and "scratch" not in tensors  # alias, non-persistent buffer
    assert_matches_live(tensors, reference)


@pytest.mark.parametrize("config", THREE_RANKS)
def test_three_ranks_export_equals_live_weights(root3, tmp_path, config):
    ckpt, tag, reference = checkpoint_of(root3, config)
    assert reference["world_size"] == 3
    export_checkpoint(ckpt, tmp_path / "out")
    tensors, tied, files = read_export(tmp_path / "out")
    assert files == ["model.safetensors"]
    assert set(tensors) | set(tied) == set(reference["state_dict_keys"])
    assert_matches_live(tensors, reference)


@pytest.mark.parametrize("config", MATRIX)
def test_load_exported_round_trip(root, tmp_path, config):
    ckpt, tag, reference = checkpoint_of(root, config)
    export_checkpoint(ckpt, tmp_path / "out", max_shard_size="16KB")
    torch.manual_seed(123)  # different initial weights than the trained model
    fresh = TinyLM(big="big" in config)
    assert load_exported(fresh, tmp_path / "out") == ([], [])
    assert fresh.head.weight is fresh.embed.weight  # tie intact
    for name, value in fresh.state_dict().items():
        owner = "embed.weight" if name == "head.weight" else name
        assert torch.equal(value, expected(reference, owner).to(value.dtype)), name


def test_bf16_export_equals_bf16_training_weights(root, tmp_path):
    """bf16 training: the bf16 export of the fp32 masters is exactly what the engine computed with."""
    ckpt, tag, reference = checkpoint_of(root, "s3_cpu_bf16")
    export_checkpoint(ckpt, tmp_path / "out", dtype="bf16")
    tensors, tied, _ = read_export(tmp_path / "out")
    for name, tensor in tensors.items():
        if name in reference["buffers"]:
            continue
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, reference["module"][name]), name


@pytest.mark.parametrize("config", [c for c in MATRIX if not c.startswith("s0") and "big" not in c])
def test_equals_deepspeed_converter(root, tmp_path, config):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt, tag, reference = checkpoint_of(root, config)
    export_checkpoint(ckpt, tmp_path / "out")
    tensors, tied, _ = read_export(tmp_path / "out")
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag)
    # DeepSpeed drops frozen parameters of stage-1 checkpoints (they are not in its frozen_param_shapes)
    dropped = {"frozen_proj.weight", "frozen_proj.bias"} if config.startswith("s1") else set()
    assert set(theirs) == (set(tensors) | set(tied)) - dropped
    for name, value in theirs.items():
        ours = tensors[tied.get(name, name)]
        assert torch.equal(ours, value.float()), name
        if name.startswith("frozen_proj"):
            # DeepSpeed returns frozen parameters in the training dtype; ours follow the requested fp32
            assert value.dtype == (torch.bfloat16 if "bf16" in config else torch.float32)
            assert ours.dtype == torch.float32


def test_deepspeed_converter_fails_where_export_works(root, tmp_path):
    """DeepSpeed's converter cannot read NVMe-offloaded or stage-0 checkpoints; these are covered above."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt, tag, _ = checkpoint_of(root, "s3_nvme_fp32_big")
    with pytest.raises(ValueError, match="consumed .* numels out of"):
        get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag)
    ckpt, tag, _ = checkpoint_of(root, "s0_none_fp32")
    with pytest.raises((TypeError, ValueError, FileNotFoundError)):  # stage 0: no param_shapes, no optimizer files
        get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag)


@pytest.mark.parametrize("config", LIGHTNING)
def test_lightning_layout(root, tmp_path, config):
    """Engine module = LightningModule (keys 'net.*'); Lightning < 2.1 wrapped it as '_forward_module.'."""
    ckpt, tag, reference = checkpoint_of(root, config)
    assert ckpt.name == "epoch=0-step=2.ckpt" and tag == "checkpoint"
    export_checkpoint(ckpt, tmp_path / "out")
    tensors, tied, _ = read_export(tmp_path / "out")
    strip = (lambda n: "_forward_module." + n) if config.startswith("litwrap") else (lambda n: n)
    assert sorted(strip(k) for k in [*tensors, *tied]) == sorted(reference["state_dict_keys"])
    assert all(k.startswith("net.") for k in tensors) and tied == {"net.head.weight": "net.embed.weight"}
    assert_matches_live(tensors, reference, rename=strip)

    # the LightningModule's state_dict names load into a module shaped like it; --strip-prefix into the bare net
    holder = torch.nn.Module()
    holder.net = TinyLM()
    assert load_exported(holder, tmp_path / "out") == ([], [])
    export_checkpoint(ckpt, tmp_path / "bare", strip_prefix="net.")
    bare = TinyLM()
    load_exported(bare, tmp_path / "bare")
    assert all(torch.equal(v, holder.net.state_dict()[k]) for k, v in bare.state_dict().items())


def test_exclude_frozen_parameters(root, tmp_path):
    ckpt, tag, reference = checkpoint_of(root, "s3_cpu_fp32")
    export_checkpoint(ckpt, tmp_path / "out", exclude_frozen_parameters=True)
    tensors, tied, _ = read_export(tmp_path / "out")
    assert set(tensors) | set(tied) == set(reference["state_dict_keys"]) - {"frozen_proj.weight", "frozen_proj.bias"}
    fresh = TinyLM()
    before = fresh.frozen_proj.weight.detach().clone()
    with pytest.raises(
        ExportError,
        match=r"missing keys \(in the module, not in the export\): "
        r"\['frozen_proj.weight', 'frozen_proj.bias'\]",
    ):
        load_exported(fresh, tmp_path / "out")
    result = load_exported(fresh, tmp_path / "out", strict=False)
    assert result.missing_keys == ["frozen_proj.weight", "frozen_proj.bias"] and result.unexpected_keys == []
    assert torch.equal(fresh.frozen_proj.weight, before)
    assert torch.equal(fresh.up.weight, reference["fp32"]["up.weight"])


def test_export_of_a_tag_directory_and_explicit_tag(root, tmp_path):
    ckpt, tag, reference = checkpoint_of(root, "mix_s2_none_fp32")
    export_checkpoint(ckpt / "step2", tmp_path / "by_dir")
    export_checkpoint(ckpt, tmp_path / "by_tag", tag="step2")
    export_checkpoint(ckpt, tmp_path / "latest")  # 'latest' names step3, the reference's step
    step2_dir, _, _ = read_export(tmp_path / "by_dir")
    step2_tag, _, _ = read_export(tmp_path / "by_tag")
    latest, _, _ = read_export(tmp_path / "latest")
    assert all(torch.equal(step2_dir[k], step2_tag[k]) for k in step2_dir)
    assert not torch.equal(step2_dir["up.weight"], latest["up.weight"])
    assert_matches_live(latest, reference)
