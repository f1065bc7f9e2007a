"""zero_auto's measured mode on 2 CPU ranks (``ZeroAutoStrategy(tune=True)``): trials of every allowed option that
fits, a table of samples/s and peak memory, the fastest chosen, the tuned run bit for bit equal to an untuned run with
the chosen config, the decision cached and reused, ``retune``, a cache of another model not reused, and the errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from _support.launch import REPO_ROOT, run_torchrun
from _support.models import RegressionModule
from lightspeed.core.zero.tuner import TuneRequest
from lightspeed.core.zero.tuner.decision import TUNE_MARGIN
from lightspeed.strategies.zero_auto import ZeroAutoStrategy

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_auto_tune.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("zero_auto_tune")
    run_torchrun(SCRIPT, 2, [out], timeout=600)
    return out, json.loads((out / "result.json").read_text())


def measured_table(lines: list[str]) -> dict[str, float]:
    """samples/s per candidate from the logged table (empty when no trials ran)."""
    tables = [line for line in lines if line.startswith("lightspeed zero_auto: measured 2 steps of each candidate")]
    if not tables:
        return {}
    rows = tables[0].splitlines()[2:]
    return {row.split()[0]: float(row.split()[1]) for row in rows}


def test_every_allowed_option_is_measured_and_the_fastest_trains(run: tuple[Path, dict[str, Any]]) -> None:
    _, result = run
    table = measured_table(result["logs"]["tuned"])
    assert list(table) == ["zero1", "zero2", "zero3"]
    fastest = max(table, key=lambda name: table[name])
    planned = "zero1"  # the planner's choice, kept unless another candidate is measured TUNE_MARGIN times as fast
    chosen = fastest if table[fastest] >= TUNE_MARGIN * table[planned] else planned
    assert result["chosen"]["tuned"] == chosen
    chosen_row = next(r for r in result["logs"]["tuned"][-1].splitlines() if r.startswith(chosen))
    assert chosen_row.endswith("<- chosen") and re.search(r"\d+(\.\d+)? [KMG]iB", chosen_row)  # peak memory


def test_the_tuned_run_equals_an_untuned_run_with_the_chosen_config_bit_for_bit(run: tuple[Path, Any]) -> None:
    out, _ = run
    tuned, fixed = torch.load(out / "tuned.pt"), torch.load(out / "fixed.pt")
    assert tuned.keys() == fixed.keys()
    assert all(torch.equal(tuned[key], fixed[key]) for key in tuned)
    start = RegressionModule().state_dict()  # the comparison is not vacuous: both trained
    assert (tuned["net.0.weight"] - start["net.0.weight"]).abs().max() > 1e-3


def test_the_decision_is_cached_reused_and_measured_again_on_request(run: tuple[Path, dict[str, Any]]) -> None:
    out, result = run
    cache = out / "cache.json"
    assert result["chosen"]["cached"] == result["chosen"]["tuned"]
    assert measured_table(result["logs"]["cached"]) == {}  # no trials
    assert result["logs"]["cached"][-1] == (
        f"lightspeed zero_auto: {result['chosen']['tuned']} from the tuning cache {str(cache)!r} (measured before for "
        "this model, world size, precision and hardware); retune=True (`lightspeed tune --retune`) "
        "measures again."
    )
    assert list(measured_table(result["logs"]["retune"])) == ["zero1", "zero2", "zero3"]
    entries = json.loads(cache.read_text())["entries"]
    assert len(entries) == 2  # this model, and the other one
    assert {entry["key"]["world_size"] for entry in entries.values()} == {2}


def test_a_cache_written_for_another_model_is_not_reused(run: tuple[Path, dict[str, Any]]) -> None:
    out, result = run
    logs = result["logs"]["other"]
    assert logs[-2] == (
        f"lightspeed zero_auto: the tuning cache {str(out / 'cache.json')!r} holds 1 decision(s) for other models, "
        "world sizes, precisions or hardware and none for this run; they are not reused. Measuring."
    )
    assert list(measured_table(logs)) == ["zero1", "zero2", "zero3"]


def test_zero3_is_measured_for_a_model_whose_attention_reads_a_weight_outside_its_module(
    run: tuple[Path, dict[str, Any]],
) -> None:
    _, result = run
    rows = [line for line in result["logs"]["attention"][-1].splitlines() if line.startswith("zero3")]
    assert rows and "failed" not in rows[0], result["logs"]["attention"][-1]  # trials go through the engine's forward
    assert list(measured_table(result["logs"]["attention"])) == ["zero2", "zero3"]


def test_bad_tuning_input_is_a_clear_error(run: tuple[Path, dict[str, Any]]) -> None:
    _, result = run
    assert result["unknown_option"] == {
        "type": "MemoryPlanError",
        "message": "tune_options names zero9, which zero_auto does not know; choose from zero1, zero2, zero2_offload, "
        "zero3, zero3_offload_optimizer, zero3_offload_params, zero3_offload, zero3_nvme.",
    }
    assert result["nothing_fits"]["type"] == "MemoryPlanError"
    assert result["nothing_fits"]["message"].startswith("No ZeRO option fits 708 parameters")


def test_tuning_arguments_are_checked_when_the_strategy_is_made() -> None:
    with pytest.raises(ValueError, match=r"^tune_steps is the number of measured steps per candidate, at least 1; "):
        ZeroAutoStrategy(tune=True, tune_steps=0)
    with pytest.raises(TypeError, match=r"^tune_options is a list of option names, e.g. \['zero2'\]"):
        ZeroAutoStrategy(tune=True, tune_options="zero2")
    assert TuneRequest.checked(True, 2, ["zero1"], False, None, False).options == ("zero1",)
