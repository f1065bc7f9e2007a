"""The memory planner's core: DeepSpeed-compatible estimates, the choice on synthetic budgets, bad input."""

from __future__ import annotations

import dataclasses
import re

import psutil
import pytest
import torch
from torch import nn

from lightspeed.core.common.sizes import parse_size
from lightspeed.core.errors import MemoryPlanError
from lightspeed.core.zero.config.facts import PRECISIONS
from lightspeed.core.zero.planner import (
    GIB,
    ZERO_OPTIONS,
    Accounting,
    Budgets,
    Cluster,
    ModelCounts,
    ZeroOption,
    count_parameters,
    counts_from_factory,
    estimate_all,
    estimate_option,
    explain_no_fit,
    format_size,
    format_table,
    measure_budgets,
    parse_count,
    plan,
    plan_to_dict,
    suggestions,
)

OPTIONS = {option.name: option for option in ZERO_OPTIONS}
COUNTS_7B = ModelCounts(7_000_000_000, 130_000_000)


class TiedLM(nn.Module):
    """Embedding and output head share one weight, as in GPT-2: DeepSpeed counts it once."""

    def __init__(self, vocab: int = 1000, width: int = 64, depth: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))


def build_tied_lm() -> nn.Module:
    return TiedLM()


def build_7b_mlp() -> nn.Module:
    """6.7B parameters: 27 GB if it were allocated in fp32."""
    return nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(100)])


def not_a_module() -> dict:
    return {"weights": 1}


# --- accounting --------------------------------------------------------------------------------------------------


def test_breakdown_adds_up_and_names_every_option_fastest_first():
    names = [e.option.name for e in estimate_all(COUNTS_7B, Cluster(8), Accounting())]
    assert names == [
        "zero1",
        "zero2",
        "zero2_offload",
        "zero3",
        "zero3_offload_optimizer",
        "zero3_offload_params",
        "zero3_offload",
        "zero3_nvme",
    ]
    for e in estimate_all(COUNTS_7B, Cluster(8), Accounting()):
        assert e.device.total == e.device.params + e.device.grads + e.device.optimizer
        assert e.host.total == int(max(e.host.load, e.host.params + e.host.grads + e.host.optimizer) * 1.5)


def test_each_slower_option_needs_no_more_device_memory_than_the_one_before():
    for cluster in (Cluster(1), Cluster(8), Cluster(8, nodes=4)):
        totals = [e.device.total for e in estimate_all(COUNTS_7B, cluster, Accounting())]
        # zero2 -> zero2_offload -> zero3 is not monotone per device (zero3 keeps partitions, zero2_offload keeps
        # full 16-bit weights); what must hold: every ZeRO-3 offload step shrinks, ZeRO-2 never exceeds ZeRO-1
        by_name = dict(zip(OPTIONS, totals, strict=False))
        assert by_name["zero2"] <= by_name["zero1"]
        assert by_name["zero2_offload"] < by_name["zero2"]
        assert by_name["zero3"] > by_name["zero3_offload_params"] > by_name["zero3_offload"] == by_name["zero3_nvme"]
        # optimizer offload leaves only the 16-bit partition and the gathered layer on the device
        assert by_name["zero3_offload_params"] > by_name["zero3_offload_optimizer"] > by_name["zero3_offload"]


def test_zero1_keeps_full_gradients_and_zero2_partitions_them():
    counts = ModelCounts(1_000_000, 1000)
    z1 = estimate_option(OPTIONS["zero1"], counts, Cluster(4), Accounting())
    z2 = estimate_option(OPTIONS["zero2"], counts, Cluster(4), Accounting())
    assert z1.device.grads == 2 * 1_000_000 + 4 * 250_000  # full 16-bit gradients + fp32 partition
    assert z2.device.grads == 2 * 250_000 + 4 * 250_000
    assert z1.device.optimizer == z2.device.optimizer == 12 * 250_000  # fp32 master + two Adam moments, partitioned


def test_fp32_training_uses_four_byte_weights_and_gradients():
    counts = ModelCounts(1_000_000, 1000)
    mixed = estimate_option(OPTIONS["zero2"], counts, Cluster(2), Accounting(precision="bf16-mixed"))
    full = estimate_option(OPTIONS["zero2"], counts, Cluster(2), Accounting(precision="32-true"))
    assert full.device.params == 2 * mixed.device.params == 4_000_000
    assert full.device.grads - mixed.device.grads == 2 * 500_000
    assert full.device.optimizer == mixed.device.optimizer


def test_nvme_keeps_states_on_disk_and_only_swap_buffers_in_host_memory():
    counts = ModelCounts(10_000_000_000, 100_000_000)
    accounting = Accounting()
    nvme = estimate_option(OPTIONS["zero3_nvme"], counts, Cluster(8, nodes=2), accounting)
    cpu = estimate_option(OPTIONS["zero3_offload"], counts, Cluster(8, nodes=2), accounting)
    assert nvme.device == cpu.device
    assert nvme.nvme_per_node == 18 * 10_000_000_000 // 2  # 2 (16-bit) + 4 (fp32) + 12 (master + moments) per node
    # swapping sized from the model: the largest layer's partition over 16 processes is 6.25M elements; each of a
    # node's 8 processes holds 3 parameter buffers of it and the largest layer in full (16-bit), the optimizer's 4
    # fp32 buffers for one sub-group (one parameter), and one parameter's gradient slot at a time (16-bit): the
    # gradient partition gives its memory back once on NVMe; accumulating steps (or not known to be one micro-batch)
    # hold the whole partition (625M 16-bit elements) between the micro-batches
    assert nvme.host.params == 8 * (3 * 6_250_000 + 100_000_000) * 2
    assert nvme.host.optimizer == 8 * 4 * 4 * 6_250_000
    assert nvme.host.grads == 8 * 2 * 6_250_000
    assert nvme.host.steady < cpu.host.steady / 3
    for accumulation in (4, None):
        accumulating = Accounting(accumulate_grad_batches=accumulation)
        held = estimate_option(OPTIONS["zero3_nvme"], counts, Cluster(8, nodes=2), accumulating)
        assert held.host.grads == 8 * 2 * 625_000_000
    # a sub_group_size of the user's: a sub-group closes once it reaches it, so up to sub_group_size + partition - 1
    grouped = estimate_option(
        OPTIONS["zero3_nvme"], counts, Cluster(8, nodes=2), Accounting(sub_group_size=100_000_000)
    )
    assert grouped.host.optimizer == 8 * 4 * 4 * 106_249_999
    assert grouped.host.params == 8 * (3 * 106_249_999 + 100_000_000) * 2


def test_nodes_divide_host_memory_per_node():
    one = estimate_option(OPTIONS["zero3_offload"], COUNTS_7B, Cluster(8, nodes=1), Accounting(zero_init=True))
    four = estimate_option(OPTIONS["zero3_offload"], COUNTS_7B, Cluster(8, nodes=4), Accounting(zero_init=True))
    assert four.host.steady == pytest.approx(one.host.steady / 4, rel=1e-9)
    assert four.device == one.device  # offloaded everything: only the largest layer stays on the device


# --- choosing ----------------------------------------------------------------------------------------------------


def _budget_for(name: str, counts: ModelCounts, cluster: Cluster, accounting: Accounting, margin: float) -> Budgets:
    """Budgets in which ``name`` fits with exactly the margin to spare."""
    e = estimate_option(OPTIONS[name], counts, cluster, accounting)
    grow = 1 / (1 - margin)
    return Budgets(
        int(e.device.total * grow) + 8,
        int(e.host.total * grow) + 8,
        nvme_free=int(e.nvme_per_node * grow) + 8 if e.nvme_per_node else None,
    )


def test_plenty_of_memory_picks_the_fastest_option():
    result = plan(COUNTS_7B, Cluster(8), Budgets(10_000 * GIB, 10_000 * GIB))
    assert result.choice.estimate.option.name == "zero1"
    assert all(v.fits for v in result.verdicts[:6])


@pytest.mark.parametrize("name", ["zero2", "zero2_offload", "zero3", "zero3_offload_optimizer", "zero3_offload"])
def test_the_fastest_option_that_fits_is_chosen(name):
    cluster, accounting, margin = Cluster(4), Accounting(zero_init=True), 0.2
    budgets = _budget_for(name, COUNTS_7B, cluster, accounting, margin)
    result = plan(COUNTS_7B, cluster, budgets, accounting, margin)
    # in budgets cut to this option's needs every faster option needs more of something (device or host)
    assert result.choice.estimate.option.name == name
    position = list(OPTIONS).index(name)
    assert all(not v.fits and v.reason.startswith("too big: ") for v in result.verdicts[:position])


def test_budget_boundary_applies_the_safety_margin():
    cluster, accounting = Cluster(2), Accounting()
    need = estimate_option(OPTIONS["zero1"], COUNTS_7B, cluster, accounting)
    roomy = 10_000 * GIB
    exact = plan(COUNTS_7B, cluster, Budgets(need.device.total * 5 // 4 + 4, roomy), accounting, 0.2)
    short = plan(COUNTS_7B, cluster, Budgets(need.device.total * 5 // 4 - 4, roomy), accounting, 0.2)
    assert exact.choice.estimate.option.name == "zero1"
    assert short.verdicts[0].fits is False
    assert re.search(r"too big: device \d+\.\d\d GiB of \d+\.\d\d GiB usable", short.verdicts[0].reason)


def test_cpu_processes_share_host_memory():
    counts, cluster = ModelCounts(50_000_000, 1_000_000), Cluster(2)
    e = estimate_option(OPTIONS["zero1"], counts, cluster, Accounting(precision="32-true"))
    shared_need = 2 * e.cpu_process_peak
    fits = plan(counts, cluster, Budgets(None, int(shared_need / 0.8) + 8), Accounting(precision="32-true"))
    assert fits.choice.estimate.option.name == "zero1"
    assert f"({format_size(e.cpu_process_peak)} per process)" in fits.choice.reason
    assert "devices share host memory" in fits.choice.reason
    tight = plan(counts, cluster, Budgets(None, int(shared_need / 0.8) - 8), Accounting(precision="32-true"))
    assert tight.choice.estimate.option.name != "zero1"
    judged = "each option is judged by its measured peak per process (below the table)"
    assert judged in format_table(fits)
    assert judged not in format_table(plan(counts, cluster, Budgets(80 * GIB, 512 * GIB)))


# The peak of one CPU process, term by term (fp32, AdamW, 2 ranks): N parameters, M = 4 N bytes (the model one
# process builds, and the ZeRO-3 model gathered until backward), P = 4 N / 2 (a partition of fp32 values).
N, LARGEST = 50_000_000, 4_000_000
M, P = 4 * N, 4 * N // 2


def _cpu_peak(name: str, **accounting: object) -> int:
    accounting.setdefault("precision", "32-true")
    estimate = estimate_option(OPTIONS[name], ModelCounts(N, LARGEST), Cluster(2), Accounting(**accounting))
    return estimate.cpu_process_peak


def test_cpu_peak_of_zero2_counts_the_built_model_once():
    # weights (the built model itself), 16-bit and fp32 gradient partitions, master + Adam moments, the step's
    # out-of-place denominator
    assert _cpu_peak("zero2") == M + P + P + 3 * P + P
    assert _cpu_peak("zero1") == M + M + P + 3 * P + P  # full gradients on every rank


def test_cpu_peak_of_zero3_holds_the_gathered_model():
    # partition of weights, gradient partition, master + moments, the step's temporary, the model gathered
    assert _cpu_peak("zero3") == P + P + 3 * P + P + M
    assert _cpu_peak("zero3_offload") == _cpu_peak("zero3") == _cpu_peak("zero3", zero_init=True)
    # at most stage3_max_live_parameters (1e9) stay gathered
    big = estimate_option(OPTIONS["zero3"], ModelCounts(4 * 10**9, 10**8), Cluster(2), Accounting("32-true"))
    assert big.cpu_process_peak == 6 * (4 * 4 * 10**9 // 2) + 4 * 10**9


def test_cpu_peak_of_zero3_nvme_is_the_built_model_and_the_swap_buffers():
    partition = LARGEST // 2  # of the largest parameter: one parameter swap buffer, one optimizer sub-group
    parameter_buffers = (3 * partition + LARGEST) * 4  # 3 buffers + DeepSpeed's partitioned swap buffer
    optimizer_buffers = 4 * 4 * partition
    assert _cpu_peak("zero3_nvme") == M + parameter_buffers  # the optimizer's buffers come once the model is gone
    # built partitioned: the steady state (gathered layer and its gradient, one parameter's gradient slot, the
    # buffers); with accumulation (or not known to be without) the whole gradient partition
    steady = 2 * 4 * LARGEST + 4 * partition + parameter_buffers + optimizer_buffers
    assert _cpu_peak("zero3_nvme", zero_init=True) == steady
    for accumulation in (2, None):
        held = _cpu_peak("zero3_nvme", zero_init=True, accumulate_grad_batches=accumulation)
        assert held == steady - 4 * partition + P


def test_nvme_needs_a_path_and_a_usable_async_io():
    cluster, accounting = Cluster(1), Accounting(zero_init=True)
    budgets = _budget_for("zero3_nvme", COUNTS_7B, cluster, accounting, 0.2)
    chosen = plan(COUNTS_7B, cluster, budgets, accounting)
    assert chosen.choice.estimate.option.name == "zero3_nvme"
    no_path = plan(COUNTS_7B, cluster, dataclasses.replace(budgets, nvme_free=None), accounting)
    assert no_path.choice is None
    assert re.search(r"needs an NVMe path with \d+\.\d\d GiB free", no_path.verdicts[-1].reason)
    broken = dataclasses.replace(budgets, nvme_unusable="DeepSpeed's async_io op is not usable: install libaio-dev")
    assert "install libaio-dev" in plan(COUNTS_7B, cluster, broken, accounting).verdicts[-1].reason


def test_nothing_fits_says_what_would_and_each_suggestion_is_true():
    counts, cluster = ModelCounts(70_000_000_000, 1_300_000_000), Cluster(8)
    budgets = Budgets(80 * GIB, 500 * GIB)
    result = plan(counts, cluster, budgets)
    assert result.choice is None
    message = explain_no_fit(result)
    assert message.startswith(
        "No ZeRO option fits 70,000,000,000 parameters on 1 node(s) x 8 device(s) with a 20% safety margin."
    )
    ideas = suggestions(result)
    assert any("NVMe path" in idea and "deepspeed.zero.Init" in idea for idea in ideas)
    nodes_idea = next(idea for idea in ideas if "nodes of 8 devices" in idea)
    nodes = int(re.search(r"(\d+) nodes of 8", nodes_idea).group(1))
    # the claim is true: with that many nodes (and zero.Init, as the suggestion says) an option fits, with half not
    assert plan(counts, Cluster(8, nodes), budgets, Accounting(zero_init=True)).choice is not None
    assert plan(counts, Cluster(8, nodes // 2), budgets, Accounting(zero_init=True)).choice is None


def test_fp32_that_does_not_fit_suggests_16_bit_precision():
    # 1B parameters on one device: fp32 needs 4 GB of weights on the device for ZeRO-2 offload and 30 GB of host
    # memory for ZeRO-3 offload; with 3 GB per device and 28 GB of host memory only bf16 ZeRO-2 offload fits
    counts, cluster = ModelCounts(1_000_000_000, 10_000_000), Cluster(1)
    budgets = Budgets(3 * 10**9, 28 * 10**9)
    result = plan(counts, cluster, budgets, Accounting(precision="32-true", zero_init=True), safety_margin=0.0)
    assert result.choice is None
    assert "bf16-mixed (or 16-mixed) precision would fit zero2_offload" in suggestions(result)
    bf16 = plan(counts, cluster, budgets, Accounting(precision="bf16-mixed", zero_init=True), safety_margin=0.0)
    assert bf16.choice.estimate.option.name == "zero2_offload"


def test_table_and_json_show_every_option_and_the_choice():
    result = plan(COUNTS_7B, Cluster(1), Budgets(80 * GIB, 251 * GIB))
    table = format_table(result)
    for name in OPTIONS:
        assert re.search(rf"^{name}\s+\|", table, re.MULTILINE)
    chosen = result.choice.estimate.option.name
    assert re.search(rf"^{chosen}\s+\|.*<- chosen$", table, re.MULTILINE)
    data = plan_to_dict(result)
    assert data["choice"] == chosen
    assert [o["name"] for o in data["options"]] == list(OPTIONS)
    assert data["options"][1]["device_bytes"]["total"] == result.verdicts[1].estimate.device.total


# --- measuring ---------------------------------------------------------------------------------------------------


def test_counts_match_deepspeed_and_work_on_the_meta_device():
    from deepspeed.runtime.zero.stage3 import model_to_params

    real = TiedLM()
    with torch.device("meta"):
        meta = TiedLM()
    expected_total, expected_largest = model_to_params(real)  # DeepSpeed's own count (tied weight once)
    assert count_parameters(real) == ModelCounts(expected_total, expected_largest)
    assert count_parameters(meta) == ModelCounts(expected_total, expected_largest)
    assert expected_total == sum(p.numel() for p in real.parameters())  # parameters() yields a tied weight once


def test_factory_is_built_on_the_meta_device_without_allocating():
    rss_before = psutil.Process().memory_info().rss
    counts = counts_from_factory(f"{__name__}:build_7b_mlp")
    grown = psutil.Process().memory_info().rss - rss_before
    assert counts == ModelCounts(100 * (8192 * 8192 + 8192), 8192 * 8192 + 8192)
    assert grown < 200 * 2**20, f"building on the meta device allocated {grown / 2**20:.0f} MiB"  # real: 26 GiB
    assert counts_from_factory(f"{__name__}:TiedLM") == count_parameters(TiedLM())


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_package.models:build", r"Cannot import 'no_such_package.models' for model factory"),
        (f"{__name__}:missing", r"has no attribute 'missing'"),
        (f"{__name__}:not_a_module", r"returned a dict, not a torch.nn.Module: make it return the model"),
        (f"{__name__}:COUNTS_7B", r"is a ModelCounts, not a function or class that builds a model"),
        ("just_a_module", r"write it as package.module:function"),
    ],
)
def test_bad_factories_are_clear_errors(path, message):
    with pytest.raises(MemoryPlanError, match=message):
        counts_from_factory(path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"total_params": 0, "largest_layer_params": 1}, r"The parameter count must be positive, got 0"),
        ({"total_params": 10, "largest_layer_params": -1}, r"largest layer's parameter count must be positive, got -1"),
        ({"total_params": 10, "largest_layer_params": 11}, r"cannot have more parameters than the whole model"),
    ],
)
def test_bad_counts(kwargs, message):
    with pytest.raises(MemoryPlanError, match=message):
        ModelCounts(**kwargs)


def test_bad_cluster_precision_and_margin():
    with pytest.raises(MemoryPlanError, match=r"devices per node must be at least 1, got 0"):
        Cluster(0)
    with pytest.raises(MemoryPlanError, match=r"number of nodes must be at least 1, got -2"):
        Cluster(1, nodes=-2)
    with pytest.raises(MemoryPlanError, match=r"Unsupported precision '64-true'"):
        Accounting(precision="64-true")
    with pytest.raises(MemoryPlanError, match=r"^accumulate_grad_batches must be at least 1, got 0\.$"):
        Accounting(accumulate_grad_batches=0)


@pytest.mark.parametrize("precision", ["16", "32", "bf16", 16, "64-true"])
def test_only_the_strategy_precisions_are_accepted(precision):
    # the ZeRO strategies take exactly these names; an estimate for another would plan a run that cannot start
    with pytest.raises(
        MemoryPlanError,
        match=re.escape(
            f"Unsupported precision {precision!r} for a ZeRO estimate: use one of 32-true, 16-mixed, bf16-mixed, "
            "16-true, bf16-true"
        ),
    ):
        Accounting(precision=precision)
    assert {p: Accounting(precision=p).param_bytes for p in PRECISIONS} == {
        "32-true": 4,
        "16-mixed": 2,
        "bf16-mixed": 2,
        "16-true": 2,
        "bf16-true": 2,
    }
    with pytest.raises(MemoryPlanError, match=r"safety margin .* between 0 and 1; got 1.5"):
        plan(COUNTS_7B, Cluster(1), Budgets(GIB, GIB), safety_margin=1.5)
    with pytest.raises(MemoryPlanError, match=r"parameter offload needs ZeRO stage 3"):
        estimate_option(ZeroOption("bad", 2, "none", "cpu"), COUNTS_7B, Cluster(1), Accounting())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GB", 80 * 10**9),
        ("24GiB", 24 * GIB),
        ("24G", 24 * GIB),
        ("512MiB", 512 * 2**20),
        ("1.5T", int(1.5 * 2**40)),
        (8, 8),
        (3 * GIB, 3 * GIB),
    ],  # an int is a number of bytes
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_and_count_errors():
    # a bare number could mean bytes or GiB: refused with the exception type the planner's callers pass
    with pytest.raises(
        MemoryPlanError,
        match=r"--device-memory '16' has no unit: write e.g. '16GB' \(10\^9 bytes\) or "
        r"'16GiB' \(2\^30 bytes\)",
    ):
        parse_size("16", "--device-memory", MemoryPlanError)
    with pytest.raises(MemoryPlanError, match=r"Unknown unit 'XB' in --device-memory '4XB'"):
        parse_size("4XB", "--device-memory", MemoryPlanError)
    with pytest.raises(MemoryPlanError, match=r"Cannot read --host-memory 'lots'"):
        parse_size("lots", "--host-memory", MemoryPlanError)
    with pytest.raises(MemoryPlanError, match=r"--params must be a positive number, got '-7e9'"):
        parse_count("-7e9", "--params")
    with pytest.raises(MemoryPlanError, match=r"--params must be a number such as 7e9, got 'seven'"):
        parse_count("seven", "--params")
    assert parse_count("1.3e8", "--largest-layer") == 130_000_000


def test_measure_budgets_takes_overrides_and_measures_the_rest(tmp_path, monkeypatch):
    import shutil

    from lightspeed.core.zero import runtime as deepspeed_runtime

    given = measure_budgets(device_memory=24 * GIB, host_memory=64 * GIB, device=torch.device("cpu"))
    assert given == Budgets(24 * GIB, 64 * GIB, None, None)  # overrides win, even over a CPU device
    cpu = measure_budgets(device=torch.device("cpu"))
    assert cpu.device_memory is None  # CPU processes: no device budget, they share the host memory
    assert abs(cpu.host_memory - psutil.virtual_memory().available) < 2 * GIB
    if not torch.cuda.is_available():
        assert measure_budgets().device_memory is None  # no GPU visible: nothing to measure

    monkeypatch.setattr(deepspeed_runtime, "async_io_problem", lambda: "no async_io here")
    nvme = measure_budgets(host_memory=GIB, nvme_path=tmp_path / "not" / "yet")
    assert nvme.nvme_unusable == "no async_io here"  # NVMe budgets say whether the offload can run at all
    assert abs(nvme.nvme_free - shutil.disk_usage(tmp_path).free) < 256 * 2**20  # the nearest existing parent
    assert measure_budgets(host_memory=GIB).nvme_unusable is None  # no path: async_io is not probed


def test_cpu_peak_of_a_partial_offload_counts_a_second_optimizer_partition():
    # offloading part of the states to "the CPU" frees nothing on CPU ranks; DeepSpeed's offload buffers come on top
    second_copy = (4 + 4 + 8) * N // 2  # fp32 master weights and gradient, Adam's moments: one partition
    assert _cpu_peak("zero2_offload") == _cpu_peak("zero2") + second_copy
    assert _cpu_peak("zero3_offload_optimizer") == _cpu_peak("zero3") + second_copy
    assert _cpu_peak("zero3_offload_params") == _cpu_peak("zero3") + second_copy
