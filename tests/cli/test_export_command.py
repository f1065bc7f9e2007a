"""``lightspeed export``: the console script on real ZeRO checkpoints (generated once per session, 2 CPU ranks).

A LightningModule-style wrapper around a tiny GPT-2 (built from a config, no download) trained with ZeRO-3 is
exported with ``--strip-prefix model.``; ``GPT2LMHeadModel.from_pretrained`` loads it with no missing key and gives
the same logits as GPT-2 holding the live fp32 weights. A single-file checkpoint from a real one-device fit exports
too. User errors exit with code 2 and one message on stderr.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "core" / "checkpoint" / "scripts"))
from checkpoint_fixture import HF, checkpoint_of, zero_checkpoints  # noqa: E402
from checkpoint_models import tiny_gpt2_config  # noqa: E402
from lightning_file_fixture import TinyLightningLM, train_and_save  # noqa: E402

from lightspeed.cli import export_command  # noqa: E402
from lightspeed.cli.main import main as cli_main  # noqa: E402


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return zero_checkpoints(tmp_path_factory)


@pytest.fixture(scope="module")
def lightning_file(tmp_path_factory) -> tuple[Path, dict]:
    """A single-file checkpoint from a real one-device CPU fit (see lightning_file_fixture.py)."""
    return train_and_save(tmp_path_factory.mktemp("lightning_file"))


def lightspeed_cli(*args: str) -> subprocess.CompletedProcess:
    """The installed console script (``python -m lightspeed.cli.main`` when the venv has no entry point)."""
    script = Path(sys.executable).with_name("lightspeed")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "lightspeed.cli.main"]
    return subprocess.run([*command, "export", *map(str, args)], capture_output=True, text=True, timeout=300)


def parse(*args: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lightspeed")
    export_command.COMMAND.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["export", *map(str, args)])


def test_strip_prefix_export_loads_with_from_pretrained(root, tmp_path):
    from transformers import GPT2LMHeadModel

    ckpt, tag, reference = checkpoint_of(root, HF)
    out = tmp_path / "gpt2"
    proc = lightspeed_cli(ckpt, out, "--strip-prefix", "model.", "--max-shard-size", "20KB")
    assert proc.returncode == 0, proc.stderr
    # piped: the result line on stdout (a log keeps it), no progress bar on stderr
    assert proc.stdout.startswith("wrote ") and f"to {out}" in proc.stdout and proc.stderr == "", proc
    assert (out / "model.safetensors.index.json").is_file()
    tiny_gpt2_config().save_pretrained(out)

    loaded, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    live = GPT2LMHeadModel(tiny_gpt2_config())
    weights = {k.removeprefix("model."): v for k, v in reference["fp32"].items()}
    live.load_state_dict(weights, strict=False)
    assert live.lm_head.weight is live.transformer.wte.weight
    for name, value in live.named_parameters():
        assert torch.equal(dict(loaded.named_parameters())[name], value), name
    tokens = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(tokens).logits, live.eval()(tokens).logits)


def test_options_reach_the_export(root, tmp_path):
    from safetensors import safe_open

    ckpt, tag, reference = checkpoint_of(root, "s3_cpu_fp32")
    out = tmp_path / "bf16"
    args = parse(ckpt, out, "--dtype", "bf16", "--exclude-frozen-parameters", "--tag", tag, "--max-shard-size", "none")
    assert export_command.run(args) == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        assert "frozen_proj.weight" not in handle.keys()
        assert torch.equal(handle.get_tensor("up.weight"), reference["fp32"]["up.weight"].bfloat16())


@pytest.mark.parametrize("case", ["missing", "occupied", "tag", "shard"])
def test_user_errors_exit_2_with_one_message(root, tmp_path, capsys, case):
    ckpt, tag, _ = checkpoint_of(root, "s2_none_fp32")
    out = tmp_path / "out"
    args = {
        "missing": (tmp_path / "nowhere", out),
        "occupied": (ckpt, out),
        "tag": (ckpt, out, "--tag", "nope"),
        "shard": (ckpt, out, "--max-shard-size", "lots"),
    }[case]
    if case == "occupied":
        out.mkdir()
        (out / "keep.txt").write_text("x")
    assert cli_main(["export", *map(str, args)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightspeed export: error: ") and captured.out == ""
    expected = {
        "missing": "nowhere: no such checkpoint",
        "occupied": "exists and is not empty; pass overwrite=True (--overwrite",
        "tag": "unknown tag 'nope'",
        "shard": "Cannot read max shard size 'lots'",
    }[case]
    assert expected in lines[0]
    assert (sorted(p.name for p in out.iterdir()) == ["keep.txt"]) if case == "occupied" else not out.exists()


def test_console_script_exit_code_and_overwrite(root, tmp_path):
    ckpt, tag, _ = checkpoint_of(root, "s2_none_fp32")
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("x")
    proc = lightspeed_cli(ckpt, out)  # a separate process: the real exit code and stderr
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "exists and is not empty" in proc.stderr
    assert export_command.run(parse(ckpt, out, "--overwrite", "--quiet")) == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_single_file_lightning_checkpoint(lightning_file, tmp_path, capsys):
    from lightspeed.export import load_exported

    ckpt, reference = lightning_file
    out = tmp_path / "bf16"
    assert export_command.run(parse(ckpt, out, "--dtype", "bf16", "--max-shard-size", "none", "--quiet")) == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    fresh = TinyLightningLM().bfloat16()
    load_exported(fresh, out)
    for key, value in fresh.state_dict().items():
        if isinstance(value, torch.Tensor):
            expected = reference[key].bfloat16() if reference[key].is_floating_point() else reference[key]
            assert torch.equal(value, expected), key
    assert fresh.model.head.weight is fresh.model.embed.weight and capsys.readouterr().err == ""


@pytest.mark.parametrize("case", ["exclude_frozen_parameters", "tag", "not_lightning"])
def test_single_file_user_errors_exit_2(lightning_file, tmp_path, capsys, case):
    ckpt, _ = lightning_file
    foreign = tmp_path / "weights.pt"
    torch.save({"weights": torch.ones(2)}, foreign)
    out = tmp_path / "out"
    args = {
        "exclude_frozen_parameters": (ckpt, out, "--exclude-frozen-parameters"),
        "tag": (ckpt, out, "--tag", "checkpoint"),
        "not_lightning": (foreign, out),
    }[case]
    assert cli_main(["export", *map(str, args)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightspeed export: error: ") and captured.out == ""
    expected = {
        "exclude_frozen_parameters": "does not record which parameters were frozen",
        "tag": "is a single-file checkpoint, which has no tags; leave out tag=... (--tag on the command line)",
        "not_lightning": "weights.pt is not a Lightning checkpoint: it has no 'state_dict' entry",
    }[case]
    assert expected in lines[0] and not out.exists()


def test_help_lists_every_option():
    parser = argparse.ArgumentParser(prog="lightspeed")
    subparsers = parser.add_subparsers(dest="command")
    export_command.COMMAND.add_parser(subparsers)
    help_text = subparsers.choices["export"].format_help()
    for option in (
        "--dtype",
        "--max-shard-size",
        "--tag",
        "--exclude-frozen-parameters",
        "--strip-prefix",
        "--overwrite",
    ):
        assert option in help_text
    assert "--exclude-frozen " not in help_text and "--exclude-frozen\n" not in help_text  # the deprecated spelling


def test_the_old_exclude_frozen_flag_still_works_with_a_warning(capsys):
    """``--exclude-frozen`` (before ``--exclude-frozen-parameters``, the strategies' ``exclude_frozen_parameters``):
    the same option, with a warning on stderr naming the new one."""
    assert parse("ckpt", "out").exclude_frozen_parameters is False
    assert capsys.readouterr().err == ""
    assert parse("ckpt", "out", "--exclude-frozen-parameters").exclude_frozen_parameters is True
    assert capsys.readouterr().err == ""
    old = parse("ckpt", "out", "--exclude-frozen")
    assert old.exclude_frozen_parameters is True and not hasattr(old, "exclude_frozen")
    assert capsys.readouterr().err == (
        "lightspeed export: warning: --exclude-frozen is deprecated and will be removed; "
        "use --exclude-frozen-parameters\n"
    )
    assert export_command._options(old).exclude_frozen_parameters is True
