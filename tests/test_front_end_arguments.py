"""The ZeRO front ends take their arguments from one place: the Trainer's and Fabric's strategies declare the same
keyword arguments (one typed dict, ``ZeroKeywords``, read through ``**arguments: Unpack[...]``) with the same defaults
(``ZERO_DEFAULTS``; the tuning knobs' are ``ZeroTuning``'s), so a setting means the same under both; and Lightning's
``LightningCLI`` (jsonargparse, which reads the typed dict) trains with them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from _support.launch import REPO_ROOT, run_python
from lightspeed.core.zero.config import ZeroTuning
from lightspeed.core.zero.config.arguments import ZERO_DEFAULTS, ZeroKeywords
from lightspeed.core.zero.config.keywords import named_arguments
from lightspeed.fabric import ZeroAutoFabricStrategy, ZeroFabricStrategy
from lightspeed.strategies import ZeroAutoStrategy, ZeroStrategy

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
