"""A finished ZeRO run's engines are freed when the next run in the process builds its own (DeepSpeed's engines are
never freed by dropping them: hooks held in C++ autograd nodes, ZeRO-3's class-level cache and module stack), and an
earlier run's Trainer that would run a released engine is refused with the reason. Only ended runs are released: a
Fabric loop (whose end Fabric never reports) keeps its engine while another run starts.

One real process, as a notebook runs them: Trainer fits one after another, a Trainer that fits twice, and two Fabric
loops, under ZeRO-2 and ZeRO-3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _support.launch import run_python
from _support.models import OUT_FEATURES

SCRIPTS = Path(__file__).parent / "scripts"

REFUSAL = (
    "this DeepSpeed engine was released when its run built a new one or another ZeRO run started in this process "
    "(lightspeed frees an ended run's engines when the next run builds its own: DeepSpeed's engines are never freed "
    "otherwise). Evaluate before starting the next run, or with the new run's Trainer or Fabric after loading the "
    "weights from a checkpoint."
)


@pytest.fixture(scope="module")
def outcome() -> dict:
    proc = run_python(SCRIPTS / "zero_release.py", ["zero2", "zero3"], timeout=600)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_the_next_run_frees_the_last_runs_trainer_model_engine_and_parameters(outcome: dict, stage: str) -> None:
    runs = outcome[stage]
    assert runs["validate_after_fit"] > 0  # the engine is kept for evaluation after fit
    assert runs["kept_until_the_next_run"] == dict.fromkeys(("trainer", "module", "engine", "parameter"), True)
    assert runs["after_the_next_run"] == dict.fromkeys(("trainer", "module", "engine", "parameter"), False)
    assert runs["same_trainer_fits_again"] == {"engine": False}


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_an_earlier_trainer_is_refused_with_the_reason_but_a_fabric_loop_still_going_keeps_its_engine(
    outcome: dict, stage: str
) -> None:
    assert outcome[stage]["earlier_trainer_validates"] == REFUSAL
    assert outcome[stage]["released_engine_saves"] == outcome[stage]["released_engine_loads"] == REFUSAL
    assert outcome[stage]["earlier_fabric_model_still_runs"] == [4, OUT_FEATURES]  # its loop has not ended
    assert outcome[stage]["earlier_fabric_engine_kept"] == {"engine": True}
