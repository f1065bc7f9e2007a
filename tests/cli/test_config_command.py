"""``lightspeed config NAME``: the strategy's DeepSpeed JSON, "auto" resolved exactly where a flag gives the value."""

from __future__ import annotations

import json

import pytest

from lightspeed.cli.main import main
from lightspeed.core.zero.config import NVME_PATH_ENV, ZERO_PRESETS, TrainingFacts, resolve_config, zero_preset


def _config(capsys, *argv: str) -> dict:
    assert main(["config", *argv]) == 0
    return json.loads(capsys.readouterr().out)  # stdout is exactly the JSON (DeepSpeed's log lines go to stderr)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("zero1", {"stage": 1}),
        ("zero2_offload", {"stage": 2, "offload_optimizer": "cpu"}),
        ("zero3_offload_optimizer", {"stage": 3, "offload_optimizer": "cpu"}),
        ("zero3_offload", {"stage": 3, "offload_optimizer": "cpu", "offload_parameters": "cpu"}),
    ],
)
def test_without_flags_every_trainer_value_stays_auto(capsys, name, kwargs):
    assert _config(capsys, name) == zero_preset(**kwargs)


def test_zero3_with_only_the_optimizer_offloaded(capsys):
    zero = _config(capsys, "zero3_offload_optimizer")["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in zero
    assert main(["config", "zero3_offload_optimiser"]) == 2
    assert "Did you mean 'zero3_offload_optimizer'?" in capsys.readouterr().err


def test_flags_resolve_their_keys_like_the_strategy_does(capsys):
    got = _config(
        capsys,
        "zero3_offload",
        "--micro-batch-size",
        "4",
        "--accumulate",
        "8",
        "--devices",
        "2",
        "--precision",
        "bf16-mixed",
        "--gradient-clip",
        "1.0",
        "--hidden-size",
        "1024",
    )
    facts = TrainingFacts(
        world_size=2,
        micro_batch_size=4,
        accumulate_grad_batches=8,
        gradient_clip_val=1.0,
        precision="bf16-mixed",
        hidden_size=1024,
    )
    assert got == resolve_config(zero_preset(3, "cpu", "cpu"), facts)
    assert "auto" not in json.dumps(got)


def test_only_the_given_flags_resolve(capsys):
    got = _config(capsys, "zero2", "--micro-batch-size", "4")
    assert got["train_micro_batch_size_per_gpu"] == 4
    assert got["gradient_accumulation_steps"] == "auto"
    assert got["bf16"] == {"enabled": "auto"}
    assert got["zero_optimization"]["reduce_bucket_size"] == "auto"  # no --hidden-size: left for the strategy
    got = _config(capsys, "zero2", "--precision", "32-true", "--hidden-size", "64")
    assert got["fp16"] == {"enabled": False} and got["bf16"] == {"enabled": False}
    assert got["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert got["train_micro_batch_size_per_gpu"] == "auto"


def test_nvme_needs_a_path_and_uses_it(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv(NVME_PATH_ENV, raising=False)
    assert main(["config", "zero3_nvme"]) == 2
    assert capsys.readouterr().err == (
        "lightspeed config: error: zero3_nvme offloads to NVMe: pass --nvme-path DIR (a directory on an NVMe drive) "
        "or set LIGHTSPEED_NVME_PATH.\n"
    )
    got = _config(capsys, "zero3_nvme", "--nvme-path", str(tmp_path))
    assert got["zero_optimization"]["offload_param"] == {
        "device": "nvme",
        "pin_memory": True,
        "nvme_path": str(tmp_path),
    }
    # the strategy's fallback: $LIGHTSPEED_NVME_PATH, made absolute and created like ZeroStrategy does
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(NVME_PATH_ENV, "swap")
    got = _config(capsys, "zero3_nvme")
    swap = str((tmp_path / "swap").resolve())
    assert (tmp_path / "swap").is_dir()
    assert got["zero_optimization"]["offload_optimizer"]["nvme_path"] == swap
    assert got["zero_optimization"]["offload_param"]["nvme_path"] == swap
    assert got == zero_preset(3, "nvme", "nvme", nvme_path=swap)
    got = _config(capsys, "zero3_nvme", "--nvme-path", str(tmp_path))  # the flag wins over the variable
    assert got["zero_optimization"]["offload_param"]["nvme_path"] == str(tmp_path)
    assert main(["config", "zero2", "--nvme-path", str(tmp_path)]) == 2
    assert "zero2 does not offload to NVMe" in capsys.readouterr().err


def test_user_config_is_merged_and_validated(capsys, tmp_path):
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"sub_group_size": 100000000}, "steps_per_print": 10}))
    got = _config(capsys, "zero3", "--config", str(user))
    assert got["zero_optimization"]["sub_group_size"] == 100000000 and got["steps_per_print"] == 10
    user.write_text(json.dumps({"zero_optimisation": {}}))
    assert main(["config", "zero3", "--config", str(user)]) == 2
    err = capsys.readouterr().err
    assert "Unknown DeepSpeed config key 'zero_optimisation' (did you mean 'zero_optimization'?)" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["zero3_ofload"], "Unknown ZeRO strategy 'zero3_ofload'. Did you mean 'zero3_offload'? Choose one of: zero1"),
        (["zero_auto"], "zero_auto chooses its DeepSpeed config at setup"),
        (["zero2", "--accumulate", "0"], "--accumulate must be at least 1, got 0"),
        (["zero2", "--precision", "64-true"], "Trainer(precision='64-true') cannot be used with DeepSpeed"),
    ],
)
def test_bad_input(capsys, argv, message):
    assert main(["config", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lightspeed config: error: ") and message in err


def test_the_help_names_every_registered_zero_strategy(capsys):
    """The names come from the presets the strategies are registered with, so the help cannot miss one."""
    from lightning.pytorch.strategies import StrategyRegistry

    registered = {
        name
        for name, entry in StrategyRegistry.items()
        if name.startswith("zero") and name != "zero_auto" and "lightspeed" in str(entry.get("strategy"))
    }
    assert registered == set(ZERO_PRESETS)
    with pytest.raises(SystemExit):
        main(["config", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    listed = help_text.split("strategy name: ", 1)[1].split(" options:")[0]
    assert [name.strip() for name in listed.split(",")] == list(ZERO_PRESETS)
