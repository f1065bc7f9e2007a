"""``PL_DEEPSPEED_CONFIG_PATH``: read when no config is given, as Lightning's DeepSpeed strategies do, by the Trainer's
and Fabric's ZeRO strategies (and ``zero_auto``), with the same checks as ``config=``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.config import CONFIG_PATH_ENV
from lightspeed.fabric import ZeroAutoFabricStrategy, ZeroFabricStrategy
from lightspeed.strategies import ZeroAutoStrategy, ZeroStrategy

FRONT_ENDS = [ZeroStrategy, ZeroFabricStrategy]


def _config_file(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("strategy", FRONT_ENDS, ids=lambda cls: cls.__name__)
def test_the_environment_config_is_merged_when_no_config_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: type
) -> None:
    path = _config_file(tmp_path, {"zero_optimization": {"reduce_bucket_size": 12345}, "steps_per_print": 7})
    monkeypatch.setenv(CONFIG_PATH_ENV, str(path))
    built = strategy(stage=2)
    assert built.config["zero_optimization"]["reduce_bucket_size"] == 12345 and built.config["steps_per_print"] == 7
    assert built.stage == 2
    explicit = strategy(stage=2, config={"steps_per_print": 9})  # an explicit config wins over the variable
    assert (
        explicit.config["steps_per_print"] == 9 and explicit.config["zero_optimization"]["reduce_bucket_size"] != 12345
    )


@pytest.mark.parametrize("strategy", [*FRONT_ENDS, ZeroAutoStrategy, ZeroAutoFabricStrategy], ids=lambda c: c.__name__)
def test_the_environment_config_is_checked_like_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: type
) -> None:
    monkeypatch.setenv(CONFIG_PATH_ENV, str(_config_file(tmp_path, {"zero_optimisation": {"stage": 2}})))
    with pytest.raises(DeepSpeedConfigError, match="zero_optimisation"):
        strategy() if "Auto" in strategy.__name__ else strategy(stage=2)
    monkeypatch.setenv(CONFIG_PATH_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(DeepSpeedConfigError) as info:
        strategy() if "Auto" in strategy.__name__ else strategy(stage=2)
    assert str(info.value) == (
        f"{CONFIG_PATH_ENV}={str(tmp_path / 'missing.json')!r} names no file. Point it at the DeepSpeed config's JSON "
        f"file, pass the config with `config=`, or unset {CONFIG_PATH_ENV}."
    )
