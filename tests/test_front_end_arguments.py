"""The ZeRO front ends take their arguments from one place: the Trainer's and Fabric's strategies declare the same
keyword arguments (one typed dict, ``ZeroKeywords``, read through ``**arguments: Unpack[...]``) with the same defaults
(``ZERO_DEFAULTS``; the tuning knobs' are ``ZeroTuning``'s), so a setting means the same under both; and Lightning's
``LightningCLI`` (jsonargparse, which reads the typed dict) trains with them."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from _support.launch import REPO_ROOT, run_python
from lightspeed.core.zero.auto_arguments import ZERO_AUTO_DEFAULTS, ZeroAutoKeywords
from lightspeed.core.zero.config import ZeroTuning
from lightspeed.core.zero.config.arguments import ZERO_DEFAULTS, ZeroKeywords
from lightspeed.core.zero.config.keywords import named_arguments
from lightspeed.fabric import ZeroAutoFabricStrategy, ZeroFabricStrategy
from lightspeed.fabric.zero_keywords import FABRIC_DEFAULTS, FabricOnlyKeywords
from lightspeed.strategies import ZeroAutoStrategy, ZeroStrategy
from lightspeed.strategies.zero_keywords import TRAINER_DEFAULTS, TrainerOnlyKeywords

#: what only one front end has: the Trainer's loop, precision plugin, launcher and several-model options; Fabric's
#: precision (the Trainer's comes as a plugin) and the loop's own tuning inputs (names read from the signatures,
#: ``**arguments: Unpack[...]`` included)
FRONT_END_ONLY = {
    ZeroStrategy: {"precision_plugin", "sync_with_dataloader", "start_method", "models"},
    ZeroFabricStrategy: {"precision"},
    ZeroAutoStrategy: {"precision_plugin", "sync_with_dataloader", "start_method", "models"},
    ZeroAutoFabricStrategy: {"precision", "tune_batches", "tune_loss"},
}


@pytest.mark.parametrize(
    ("trainer", "fabric"), [(ZeroStrategy, ZeroFabricStrategy), (ZeroAutoStrategy, ZeroAutoFabricStrategy)]
)
def test_trainer_and_fabric_strategies_take_the_same_arguments(trainer: type, fabric: type) -> None:
    ours, theirs = named_arguments(trainer), named_arguments(fabric)
    assert set(ours) - FRONT_END_ONLY[trainer] == set(theirs) - FRONT_END_ONLY[fabric]
    assert "reduce_bucket_size" in ours and "sync_with_dataloader" in ours  # read through `Unpack[...]`


def test_every_zero_argument_has_one_default_and_the_tuning_knobs_are_zero_tunings() -> None:
    assert set(ZERO_DEFAULTS) == set(ZeroKeywords.__annotations__)
    assert set(ZERO_AUTO_DEFAULTS) == set(ZeroAutoKeywords.__annotations__)
    assert set(TRAINER_DEFAULTS) == set(TrainerOnlyKeywords.__annotations__)
    assert set(FABRIC_DEFAULTS) == set(FabricOnlyKeywords.__annotations__)
    for field in dataclasses.fields(ZeroTuning):
        assert ZERO_DEFAULTS[field.name] == field.default, field.name


def test_what_is_left_out_takes_the_same_default_under_both_front_ends() -> None:
    trainer, fabric = ZeroStrategy(), ZeroFabricStrategy()
    assert trainer.config == fabric.config and trainer.config["zero_optimization"]["stage"] == 2
    for strategy in (trainer, fabric):
        assert strategy._timeout == ZERO_DEFAULTS["timeout"]
        assert strategy._session.unused_parameters == "skip" and strategy._session.leaf_modules.detects


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--trainer.strategy=lightspeed.strategies.ZeroStrategy", "--trainer.strategy.stage=3"], (3, "none")),
        (["--trainer.strategy=zero2_offload"], (2, "cpu")),
    ],
    ids=["class-with-stage", "registered-name"],
)
def test_lightning_cli_trains_with_a_zero_strategy(tmp_path: Path, arguments: list[str], expected: tuple) -> None:
    out = tmp_path / "run.json"
    common = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_steps=3", "--trainer.logger=false"]
    common += ["--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false"]
    common += [f"--trainer.default_root_dir={tmp_path}"]  # where LightningCLI saves its config.yaml
    script = REPO_ROOT / "tests" / "strategies" / "scripts" / "cli_job.py"
    run_python(script, ["fit", *arguments, *common], env={"LIGHTSPEED_TEST_OUT": str(out)}, timeout=300)
    record = json.loads(out.read_text())
    assert (record["stage"], record["offload_optimizer"]) == expected
    assert record["strategy"] == "ZeroStrategy" and record["world_size"] == 2 and record["global_step"] == 3


def test_a_type_checker_catches_a_misspelt_or_mistyped_zero_argument(tmp_path: Path) -> None:
    """The typed dicts reach users' type checkers (lightspeed ships ``py.typed``): mypy, as a user runs it on their
    script, names the misspelt keyword under the Trainer and the mistyped one under Fabric, and accepts the rest."""
    script = tmp_path / "user_script.py"
    script.write_text(
        "from lightspeed.fabric import ZeroFabricStrategy\n"
        "from lightspeed.strategies import ZeroStrategy\n"
        "ZeroStrategy(stage=3, offload_optimzer='cpu')\n"
        "ZeroFabricStrategy(stage='three')\n"
        "ZeroStrategy(stage=3, offload_optimizer='cpu', sync_with_dataloader=False, reduce_bucket_size=1000)\n"
        "ZeroFabricStrategy(stage=3, precision=None, tiled_logits_loss=1024)\n"
    )
    # lightspeed's own modules are read, what they import (torch, Lightning, DeepSpeed) is not: seconds, not minutes
    (tmp_path / "mypy.ini").write_text(
        "[mypy]\nignore_missing_imports = True\nfollow_imports = skip\n[mypy-lightspeed.*]\nfollow_imports = silent\n"
    )
    command = [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", script.name]
    found = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    errors = [line for line in found.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2, found.stdout
    assert 'user_script.py:3: error: Unexpected keyword argument "offload_optimzer" for "ZeroStrategy"' in errors[0]
    assert 'user_script.py:4: error: Argument "stage" to "ZeroFabricStrategy" has incompatible type "str"' in errors[1]
