"""zero_auto end to end on 2 CPU ranks: it measures the model and the machine, picks the fastest option that fits
(real budgets, and synthetic ones that force ZeRO-2 and ZeRO-3), logs the table, trains to the same weights as a
single-process reference, and fails with the planner's message when nothing fits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _support.launch import REPO_ROOT, run_torchrun
from _support.models import RegressionModule, reference_training
from lightspeed.core.errors import DeepSpeedConfigError, MemoryPlanError
from lightspeed.core.zero.planner import Accounting, Budgets, Cluster, count_parameters, estimate_all, format_size, plan
from strategies.scripts.zero_auto_models import DeepRegressionModule, make_deep_net

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_auto_train.py"
STEPS, DEVICES, BATCH, MARGIN = 4, 2, 4, 0.2
ACCOUNTING = Accounting(precision="32-true")  # the Trainer's default precision on the CPU


def _budgets_choosing(name: str, module: torch.nn.Module, memory: str) -> dict[str, int | None]:
    """``ZeroAutoStrategy`` budgets in which ``name`` is the fastest option that fits, checked with the planner:
    ``memory="host"`` is host memory that the CPU ranks share; ``"device"`` a device budget as on an accelerator
    (with host memory to spare), the one way to make optimizer offload pay on a machine of CPU ranks."""
    counts, cluster = count_parameters(module), Cluster(DEVICES)
    estimate = next(e for e in estimate_all(counts, cluster, ACCOUNTING) if e.option.name == name)
    if memory == "host":
        budgets = Budgets(None, int(DEVICES * estimate.cpu_process_peak / (1 - MARGIN)) + 16)
    else:
        budgets = Budgets(int(estimate.device.total / (1 - MARGIN)) + 16, 2**40)
    chosen = plan(counts, cluster, budgets, ACCOUNTING, MARGIN).choice
    assert chosen is not None and chosen.estimate.option.name == name, "test set-up: budget does not isolate the option"
    if memory == "host":
        return {"host_memory": budgets.host_memory}
    return {"device_memory": budgets.device_memory, "host_memory": budgets.host_memory}


CASES = {
    "measured": ("regression", {}),
    "tight_zero2": ("regression", {"host": "zero2"}),
    "zero3_optimizer_offload": ("deep", {"device": "zero3_offload_optimizer"}),
    "zero3_configure_model": ("deep_configure", {"device": "zero3_offload_optimizer"}),
    "nothing_fits": ("regression", {"host_memory": 1000}),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zero_auto")
    cases = []
    for name, (model, kwargs) in CASES.items():
        kwargs = dict(kwargs)
        for memory in ("host", "device"):
            if memory in kwargs:
                module = RegressionModule() if model == "regression" else DeepRegressionModule()
                kwargs.update(_budgets_choosing(kwargs.pop(memory), module, memory))
        cases.append({"name": name, "model": model, "kwargs": kwargs})
    run_torchrun(SCRIPT, DEVICES, [out, json.dumps(cases), "--steps", STEPS, "--batch", BATCH])
    return out


def _meta(results: Path, name: str) -> dict:
    return json.loads((results / f"{name}.json").read_text())


def _assert_weights(results: Path, name: str, reference: dict[str, torch.Tensor]) -> None:
    weights = torch.load(results / f"{name}.pt")
    assert sorted(weights) == sorted(reference)
    for key, expected in reference.items():
        diff = (weights[key] - expected).abs().max().item()
        assert diff <= 1e-5, f"{name}: {key} differs from the single-process reference by {diff:.3e}"


@pytest.fixture(scope="module")
def regression_reference() -> dict[str, torch.Tensor]:
    return reference_training(steps=STEPS, world_size=DEVICES, batch=BATCH)


@pytest.fixture(scope="module")
def deep_reference() -> dict[str, torch.Tensor]:
    return reference_training(steps=STEPS, world_size=DEVICES, batch=BATCH, net=make_deep_net())


def test_measured_budgets_pick_zero1_for_a_small_model(results, regression_reference):
    meta = _meta(results, "measured")
    assert meta["chosen"] == "zero1"  # this machine has GiBs free; a 708-parameter model fits the fastest option
    assert meta["config"]["zero_optimization"]["stage"] == 1
    assert meta["plan_cluster"] == [2, 1]
    counts = count_parameters(RegressionModule())
    assert meta["plan_counts"] == [counts.total_params, counts.largest_layer_params]
    assert meta["plan_budgets"][0] is None and meta["plan_budgets"][1] > 2**30  # CPU: devices share host memory
    assert meta["plan_accumulation"] == 1  # the Trainer's (None: not known, planned as accumulating)
    assert meta["global_step"] == STEPS and meta["world_size"] == DEVICES
    _assert_weights(results, "measured", regression_reference)


def test_logs_the_table_and_the_choice(results):
    logged = "\n".join(_meta(results, "measured")["logged"])
    assert "lightspeed zero_auto: memory plan" in logged
    for name in (
        "zero1",
        "zero2",
        "zero2_offload",
        "zero3",
        "zero3_offload_optimizer",
        "zero3_offload_params",
        "zero3_offload",
        "zero3_nvme",
    ):
        assert f"\n{name} " in logged
    assert "Choice: zero1 (ZeRO-1: optimizer states partitioned), the fastest option that fits." in logged
    assert "safety margin 20%" in logged


def test_tight_host_memory_moves_to_zero2(results, regression_reference):
    meta = _meta(results, "tight_zero2")
    assert meta["chosen"] == "zero2"
    assert meta["config"]["zero_optimization"]["stage"] == 2
    assert "zero1: too big: host" in "\n".join(meta["logged"])
    _assert_weights(results, "tight_zero2", regression_reference)


@pytest.mark.parametrize("name", ["zero3_optimizer_offload", "zero3_configure_model"])
def test_tight_device_memory_moves_to_zero3_with_optimizer_offload(results, deep_reference, name):
    meta = _meta(results, name)
    assert meta["chosen"] == "zero3_offload_optimizer"  # the first option that fits: ZeRO-2 offload did not
    assert "zero2_offload: too big: device" in "\n".join(meta["logged"])
    assert "zero3: too big: device" in "\n".join(meta["logged"])
    zero = meta["config"]["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "cpu"
    assert "offload_param" not in zero  # the parameters stay on the device
    assert meta["optimizer"] == "DeepSpeedCPUAdam"  # the optimizer steps on the CPU
    _assert_weights(results, name, deep_reference)


def test_nothing_fits_stops_with_what_would(results):
    error = _meta(results, "nothing_fits")["error"]
    assert error.startswith("No ZeRO option fits 708 parameters on 1 node(s) x 2 device(s) with a 20% safety margin.")
    # 1000 bytes of host memory, 80% usable; the smallest option on CPU ranks (ZeRO-2, the first of those that tie
    # with it) needs kilobytes
    counts = count_parameters(RegressionModule())
    estimates = estimate_all(counts, Cluster(DEVICES), ACCOUNTING)
    smallest = next(e for e in estimates if e.option.name == "zero2")
    assert smallest.cpu_process_peak == min(e.cpu_process_peak for e in estimates)
    need, each = format_size(DEVICES * smallest.cpu_process_peak), format_size(smallest.cpu_process_peak)
    assert f"The smallest, zero2, is too big: host {need} ({each} per process) of {format_size(800)}" in error
    assert error.endswith("use a smaller model or devices with more memory.")


def test_registered_and_rejects_what_it_chooses_itself():
    from lightning.pytorch.strategies import StrategyRegistry

    import lightspeed  # noqa: F401
    from lightspeed.strategies.zero_auto import ZeroAutoStrategy

    assert StrategyRegistry["zero_auto"]["strategy"] is ZeroAutoStrategy
    with pytest.raises(DeepSpeedConfigError, match=r"zero_auto chooses `stage` itself"):
        ZeroAutoStrategy(stage=3)
    with pytest.raises(DeepSpeedConfigError, match=r"sets zero_optimization.stage, zero_optimization.offload_param"):
        ZeroAutoStrategy(config={"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    with pytest.raises(MemoryPlanError, match=r"between 0 and 1; got 1.5"):
        ZeroAutoStrategy(safety_margin=1.5)
    with pytest.raises(MemoryPlanError, match=r"Cannot read host_memory 'lots'"):
        ZeroAutoStrategy(host_memory="lots")
    with pytest.raises(MemoryPlanError, match=r"device_memory '24' has no unit: write e.g. '24GB'"):
        ZeroAutoStrategy(device_memory="24")
    strategy = ZeroAutoStrategy(device_memory="24GiB", host_memory=5 * 10**9)  # the one size parser: ints are bytes
    assert (strategy.request.device_memory, strategy.request.host_memory) == (24 * 2**30, 5 * 10**9)
