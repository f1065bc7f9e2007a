"""Exports that ``from_pretrained`` loads: ``config.json`` (and ``generation_config.json``) written beside the weights,
from a config object, a path, or the exported model itself; inside the atomic output, with clear errors.

The checkpoints here are single-file Lightning checkpoints of a tiny GPT-2 (no download, no training ranks); the
2-rank ZeRO-3 run with the ZeroExport callback is in tests/callbacks/test_zero_export.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel

from lightspeed.cli.main import main
from lightspeed.core.checkpoint.hf_config import HFConfigFiles, find_hf_config, resolve_hf_config
from lightspeed.core.checkpoint.options import ExportOptions
from lightspeed.errors import ExportError
from lightspeed.export import export_checkpoint

TINY = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 100, "n_positions": 32}


class Wrapper(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT2LMHeadModel(GPT2Config(**TINY))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, Wrapper]:
    torch.manual_seed(3)
    wrapper = Wrapper().eval()
    with torch.no_grad():  # weights unlike a fresh model's, so a load that silently re-initialises would show
        for param in wrapper.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    path = tmp_path_factory.mktemp("hf") / "last.ckpt"
    torch.save({"state_dict": wrapper.state_dict(), "pytorch-lightning_version": "2.5.0"}, path)
    return path, wrapper


def _tokens() -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1))


def _assert_same_logits(out: Path, wrapper: Wrapper) -> None:
    loaded = GPT2LMHeadModel.from_pretrained(out)
    assert not loaded.training
    with torch.no_grad():
        expected = wrapper.model(input_ids=_tokens()).logits
        got = loaded(input_ids=_tokens()).logits
    assert (got - expected).abs().max().item() <= 1e-6


def test_config_object_makes_the_export_load_with_from_pretrained(checkpoint, tmp_path):
    path, wrapper = checkpoint
    out = tmp_path / "out"
    result = export_checkpoint(path, out, strip_prefix="model.", hf_config=wrapper.model.config)
    assert result.files == ["model.safetensors", "config.json"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["n_embd"] == 32
    _assert_same_logits(out, wrapper)


def test_cli_copies_config_from_a_directory_or_a_file(checkpoint, tmp_path, capsys):
    path, wrapper = checkpoint
    saved = tmp_path / "saved"
    wrapper.model.config.save_pretrained(saved)
    wrapper.model.generation_config.save_pretrained(saved)
    argv = ["export", str(path), str(tmp_path / "from_dir"), "--strip-prefix", "model.", "--quiet"]
    assert main([*argv, "--hf-config", str(saved)]) == 0
    names = sorted(p.name for p in (tmp_path / "from_dir").iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors"]
    assert (tmp_path / "from_dir" / "config.json").read_bytes() == (saved / "config.json").read_bytes()
    generation = GenerationConfig.from_pretrained(tmp_path / "from_dir")
    assert generation.to_dict() == wrapper.model.generation_config.to_dict()
    _assert_same_logits(tmp_path / "from_dir", wrapper)

    argv[2] = str(tmp_path / "from_file")
    assert main([*argv, "--hf-config", str(saved / "config.json")]) == 0
    assert sorted(p.name for p in (tmp_path / "from_file").iterdir()) == ["config.json", "model.safetensors"]
    _assert_same_logits(tmp_path / "from_file", wrapper)


def test_cli_refuses_a_missing_config_and_writes_nothing(checkpoint, tmp_path, capsys):
    path, _ = checkpoint
    out = tmp_path / "out"
    assert main(["export", str(path), str(out), "--hf-config", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    missing = tmp_path / "nowhere"
    assert f"hf_config {missing} does not exist; pass a config.json file or the directory holding it" in err
    (tmp_path / "empty").mkdir()
    assert main(["export", str(path), str(out), "--hf-config", str(tmp_path / "empty")]) == 2
    assert f"hf_config directory {tmp_path / 'empty'} has no config.json" in capsys.readouterr().err
    assert not out.exists()


def test_options_reject_what_is_not_a_config():
    with pytest.raises(ExportError, match=r"hf_config must be a Hugging Face config .* got dict"):
        ExportOptions(hf_config={"n_embd": 32})


def test_a_failing_config_write_leaves_nothing(checkpoint, tmp_path):
    path, _ = checkpoint

    class Broken:
        def to_json_file(self, target):
            Path(target).write_text("{")
            raise OSError("disk full")

    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        export_checkpoint(path, out, strip_prefix="model.", hf_config=Broken())
    assert list(tmp_path.iterdir()) == []  # neither the output nor a staging directory


def test_an_object_with_only_save_pretrained_is_used(checkpoint, tmp_path):
    path, wrapper = checkpoint

    class OnlySavePretrained:
        def save_pretrained(self, directory):
            wrapper.model.config.save_pretrained(directory)

    out = tmp_path / "out"
    result = export_checkpoint(path, out, strip_prefix="model.", hf_config=OnlySavePretrained())
    assert result.files == ["model.safetensors", "config.json"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    _assert_same_logits(out, wrapper)


def test_the_config_is_found_on_the_module_at_the_prefix():
    wrapper = Wrapper()
    found = find_hf_config(wrapper, "model.")
    assert found == HFConfigFiles(wrapper.model.config, wrapper.model.generation_config)
    assert find_hf_config(wrapper.model, None) == found
    assert find_hf_config(wrapper, None) is None  # the wrapper has no config: its keys are not the HF model's
    assert find_hf_config(wrapper, "model.transformer.") == HFConfigFiles(wrapper.model.transformer.config, None)
    assert find_hf_config(wrapper, "nothing.") is None
    plain = torch.nn.Linear(2, 2)
    plain.config = {"not": "a config"}  # type: ignore[assignment]
    assert find_hf_config(plain, None) is None
    assert resolve_hf_config(found) is found
