"""zero_auto's measured mode on 2 CPU ranks (``ZeroAutoStrategy(tune=True)``): trials of every allowed option that
fits, a table of samples/s and peak memory, the fastest chosen, the tuned run bit for bit equal to an untuned run with
the chosen config, the decision cached and reused, ``retune``, a cache of another model not reused, micro-batch sizes
tried and applied (``tune_micro_batches``), and the errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from _support.launch import REPO_ROOT, run_torchrun
from _support.models import RegressionModule, make_regression_data
from lightspeed.core.errors import DeepSpeedConfigError, MemoryPlanError
from lightspeed.core.zero.tuner import TuneRequest, first_batches, micro_batch_choices, rebatched
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
    assert result["accumulation_scheduler"] == {
        "type": "ValueError",
        "message": "tune_micro_batches sets accumulate_grad_batches to keep the samples per optimizer step, but a "
        "GradientAccumulationScheduler changes it every epoch; remove one of the two.",
    }
    assert result["nothing_fits"]["type"] == "MemoryPlanError"
    assert result["nothing_fits"]["message"].startswith("No ZeRO option fits 708 parameters")


def test_tuning_arguments_are_checked_when_the_strategy_is_made() -> None:
    with pytest.raises(ValueError, match=r"^tune_steps is the number of measured steps per candidate, at least 1; "):
        ZeroAutoStrategy(tune=True, tune_steps=0)
    with pytest.raises(TypeError, match=r"^tune_options is a list of option names, e.g. \['zero2'\]"):
        ZeroAutoStrategy(tune=True, tune_options="zero2")
    assert TuneRequest.checked(True, 2, ["zero1"], False, None, False).options == ("zero1",)
    # a name zero_auto cannot choose (a strategy name the planner has no option for) fails here, not during fit
    with pytest.raises(MemoryPlanError, match=r"^tune_options names zero1_offload, which zero_auto does not know; "):
        ZeroAutoStrategy(tune=True, tune_options=["zero1", "zero1_offload"])
    # trials run whole batches, which sequence parallelism would split
    with pytest.raises(DeepSpeedConfigError, match=r"^zero_auto's tune=True measures training steps on whole batches"):
        ZeroAutoStrategy(tune=True, sequence_parallel_size=2)
    assert ZeroAutoStrategy(sequence_parallel_size=2)._session.sequence_parallel.size == 2


def test_micro_batch_sizes_are_measured_and_a_chosen_one_rebatches_the_run_like_an_untuned_run(
    run: tuple[Path, dict[str, Any]],
) -> None:
    """batch_size=4 x accumulate_grad_batches=2 with tune_micro_batches=[2, 8]: the run's own size first, each with
    the accumulation that keeps 8 samples per rank and step; micro-batches of 8 (forced) re-batch the DataLoader,
    set accumulate_grad_batches=1, and train bit for bit as a run written with batch_size=8."""
    out, result = run
    assert list(measured_table(result["logs"]["micro"])) == ["zero2", "zero2+micro_batch_2", "zero2+micro_batch_8"]
    assert result["logs"]["micro"][-1] == (
        "lightspeed zero_auto: training with micro-batches of 8 and accumulate_grad_batches=1 (the same samples per "
        "optimizer step as the DataLoader's batch_size=4 x accumulate_grad_batches=2)."
    )
    assert result["batching"]["micro"] == result["batching"]["micro_fixed"] == [8, 1]
    assert result["batching"]["tuned"] == [4, 1]
    tuned, fixed = torch.load(out / "micro.pt"), torch.load(out / "micro_fixed.pt")
    assert tuned.keys() == fixed.keys() and all(torch.equal(tuned[key], fixed[key]) for key in tuned)
    start = RegressionModule().state_dict()
    assert (tuned["net.0.weight"] - start["net.0.weight"]).abs().max() > 1e-3


def test_micro_batch_tuning_input_is_checked(tmp_path: Path) -> None:
    for wrong in ("4", [0], [True], 4, []):
        with pytest.raises(
            ValueError, match=r"^tune_micro_batches is a list of the micro-batch sizes the tuner may try"
        ):
            ZeroAutoStrategy(tune=True, tune_micro_batches=wrong)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^tune_micro_batches is what tune=True may try; set tune=True as well"):
        ZeroAutoStrategy(tune_micro_batches=[2])
    with pytest.raises(ValueError) as caught:
        ZeroAutoStrategy(tune=True, tune_micro_batches=[2], config={"train_micro_batch_size_per_gpu": 4})
    assert str(caught.value) == (
        "tune_micro_batches lets the tuner choose the micro-batch size and accumulation, but the DeepSpeed config "
        'fixes train_micro_batch_size_per_gpu=4; set them to "auto" (or remove them), or leave tune_micro_batches '
        "unset."
    )
    assert micro_batch_choices([8, 2, 2, 4], 4, 2) == [(8, 1), (2, 4)]  # the run's own size (4 x 2) aside
    with pytest.raises(ValueError) as caught:
        micro_batch_choices([3, 16], 4, 2)
    assert str(caught.value) == (
        "tune_micro_batches=[3, 16] holds 3, 16, which do not divide the 8 samples each rank trains per optimizer "
        "step (micro-batch 4 x accumulation 2); the tuner keeps that batch, so it can only try sizes that divide it: "
        "1, 2, 4, 8."
    )
    with pytest.raises(ValueError, match=r"^tune_micro_batches needs the run's micro-batch size, but the training "):
        micro_batch_choices([2], None, 1)


def test_trial_batches_of_another_size_hold_the_loaders_samples_in_its_order() -> None:
    data = make_regression_data(12)
    torch.manual_seed(3)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    state = torch.random.get_rng_state()
    order = torch.cat([x for x, _ in loader])
    torch.random.set_rng_state(state)
    halves = first_batches(loader, 10, 2)
    assert [len(x) for x, _ in halves] == [2] * 6 and torch.equal(torch.cat([x for x, _ in halves]), order)
    assert [len(x) for x, _ in first_batches(loader, 2)] == [4, 4]
    odd = DataLoader(data, batch_sampler=[[0, 1], [2]])
    with pytest.raises(ValueError, match=r"^tune_micro_batches re-batches the training data, which needs a torch "):
        rebatched(odd, 2)
