"""The ZeRO front ends take their arguments from one place: the Trainer's and Fabric's strategies declare the same
keyword arguments with the same defaults (the tuning knobs' defaults are ``ZeroTuning``'s), so a setting means the
same under both; and Lightning's ``LightningCLI`` (jsonargparse, which reads the signature) trains with them."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest

from _support.launch import REPO_ROOT, run_python
from lightspeed.core.zero.config import ZeroTuning
from lightspeed.fabric import ZeroAutoFabricStrategy, ZeroFabricStrategy
from lightspeed.strategies import ZeroAutoStrategy, ZeroStrategy

#: what only one front end has: the Trainer's loop, precision plugin, launcher and several-model options; Fabric's
#: precision (the Trainer's comes as a plugin) and the loop's own tuning inputs
FRONT_END_ONLY = {
    ZeroStrategy: {"precision_plugin", "sync_with_dataloader", "start_method", "models"},
    ZeroFabricStrategy: {"precision"},
    ZeroAutoStrategy: set(),
    ZeroAutoFabricStrategy: {"tune_batches", "tune_loss"},
}


def _named(cls: type) -> dict[str, inspect.Parameter]:
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {name: p for name, p in inspect.signature(cls).parameters.items() if p.kind in kinds}


@pytest.mark.parametrize(
    ("trainer", "fabric"), [(ZeroStrategy, ZeroFabricStrategy), (ZeroAutoStrategy, ZeroAutoFabricStrategy)]
)
def test_trainer_and_fabric_strategies_take_the_same_arguments(trainer: type, fabric: type) -> None:
    ours, theirs = _named(trainer), _named(fabric)
    shared = set(ours) - FRONT_END_ONLY[trainer]
    assert shared == set(theirs) - FRONT_END_ONLY[fabric]
    assert {name: ours[name].default for name in shared} == {name: theirs[name].default for name in shared}


def test_the_tuning_knobs_default_to_zero_tuning() -> None:
    for strategy in (ZeroStrategy, ZeroFabricStrategy):
        parameters = _named(strategy)
        for field in dataclasses.fields(ZeroTuning):
            assert parameters[field.name].default == field.default, (strategy.__name__, field.name)


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
