"""Cross-check: for 50M and 200M parameter models, every option DeepSpeed's estimators cover is within 5% of them.

The models are GPT-2 shaped transformers built on the meta device (no memory), counted by lightspeed; the same
counts go into DeepSpeed's ``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``.
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lightspeed.core.zero.planner import (
    GIB,
    ZERO_OPTIONS,
    Accounting,
    Budgets,
    Cluster,
    ModelCounts,
    count_parameters,
    estimate_option,
    format_table,
    plan,
)

OPTIONS = {option.name: option for option in ZERO_OPTIONS}
# DeepSpeed's middle row, ZeRO-3 with only the optimizer offloaded, is one of the planner's options
ZERO3_OPTIMIZER_OFFLOAD = OPTIONS["zero3_offload_optimizer"]


def _gpt2_counts(layers: int, width: int) -> ModelCounts:
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=8, vocab_size=50257, n_positions=1024)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    return count_parameters(model)


@pytest.fixture(scope="module")
def models() -> dict[str, ModelCounts]:
    counts = {"50M": _gpt2_counts(2, 768), "200M": _gpt2_counts(7, 1280)}
    assert 45e6 < counts["50M"].total_params < 55e6
    assert 190e6 < counts["200M"].total_params < 210e6
    return counts


SHAPES = [(1, 1), (4, 1), (8, 1), (8, 2), (2, 4)]  # (devices per node, nodes)


@pytest.mark.parametrize("size", ["50M", "200M"])
@pytest.mark.parametrize(("gpus", "nodes"), SHAPES)
@pytest.mark.parametrize("zero_init", [True, False])
def test_zero3_options_match_deepspeed(models, size, gpus, nodes, zero_init):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    counts = models[size]
    cases = [
        (OPTIONS["zero3"], False, False),
        (ZERO3_OPTIMIZER_OFFLOAD, True, False),
        (OPTIONS["zero3_offload"], True, True),
    ]
    for option, cpu_offload, cpu_offload_params in cases:
        ds_cpu, ds_gpu, _ = estimate_zero3_model_states_mem_needs(
            total_params=counts.total_params,
            largest_layer_params=counts.largest_layer_params,
            num_gpus_per_node=gpus,
            num_nodes=nodes,
            cpu_offload=cpu_offload,
            cpu_offload_params=cpu_offload_params,
            zero_init=zero_init,
            additional_buffer_factor=1.5,
        )
        ours = estimate_option(option, counts, Cluster(gpus, nodes), Accounting(zero_init=zero_init))
        assert ours.device.total == pytest.approx(ds_gpu, rel=0.05), option.name
        assert ours.host.total == pytest.approx(ds_cpu, rel=0.05), option.name


@pytest.mark.parametrize("size", ["50M", "200M"])
@pytest.mark.parametrize(("gpus", "nodes"), SHAPES)
def test_zero2_options_match_deepspeed(models, size, gpus, nodes):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    counts = models[size]
    for option, cpu_offload in ((OPTIONS["zero2"], False), (OPTIONS["zero2_offload"], True)):
        ds_cpu, ds_gpu = estimate_zero2_model_states_mem_needs(
            total_params=counts.total_params,
            num_gpus_per_node=gpus,
            num_nodes=nodes,
            cpu_offload=cpu_offload,
            additional_buffer_factor=1.5,
        )
        ours = estimate_option(option, counts, Cluster(gpus, nodes), Accounting())
        assert ours.device.total == pytest.approx(ds_gpu, rel=0.05), option.name
        if cpu_offload and nodes > 1:
            # DeepSpeed's ZeRO-2 offload formula multiplies by the GPUs of all nodes (max(4 * total_gpus, 16));
            # host memory is per node, so lightspeed counts like DeepSpeed's own ZeRO-3 formula does:
            # max(4 * gpus_per_node, 16 / nodes). On one node the two agree (checked above with nodes == 1).
            single_node_cpu, _ = estimate_zero2_model_states_mem_needs(
                total_params=counts.total_params, num_gpus_per_node=gpus, num_nodes=1, cpu_offload=True
            )
            expected = counts.total_params * max(4 * gpus, 16 / nodes) * 1.5
            assert ours.host.total == pytest.approx(expected, rel=1e-6)
            assert ours.host.total <= single_node_cpu
        else:
            assert ours.host.total == pytest.approx(ds_cpu, rel=0.05), option.name


def test_deepspeeds_middle_row_is_in_the_table():
    """DeepSpeed's estimator for 2783M parameters, largest layer 65M, 1 GPU: "offload_param=none,
    offload_optimizer=cpu: 5.43GB per GPU, 62.20GB CPU" (GB = 2^30 bytes in its printout)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    counts = ModelCounts(2_783_000_000, 65_000_000)
    ds_cpu, ds_gpu, _ = estimate_zero3_model_states_mem_needs(
        total_params=counts.total_params,
        largest_layer_params=counts.largest_layer_params,
        num_gpus_per_node=1,
        num_nodes=1,
        cpu_offload=True,
        cpu_offload_params=False,
        zero_init=True,
        additional_buffer_factor=1.5,
    )
    assert (round(ds_gpu / GIB, 2), round(ds_cpu / GIB, 2)) == (5.43, 62.2)
    result = plan(counts, Cluster(1), Budgets(8 * GIB, 128 * GIB), Accounting(zero_init=True))
    row = next(v for v in result.verdicts if v.estimate.option.name == "zero3_offload_optimizer")
    assert row.estimate.device.total == ds_gpu  # 4 bytes x largest layer + 2 bytes x parameters, exactly
    assert row.estimate.host.total == ds_cpu  # 16 bytes x parameters x 1.5, exactly
    assert row.fits and row.reason == "fits: device 5.43 GiB of 6.40 GiB usable; host 62.20 GiB of 102.40 GiB usable"
    table = format_table(result).splitlines()
    line = next(text for text in table if text.startswith("zero3_offload_optimizer "))
    assert line.split("|")[1].split() == ["5.30G", "124.0M", "0", "5.43G"]
    assert line.split("|")[2].split()[-1] == "62.20G"
    # this budget fits ZeRO-2 with the optimizer offloaded first: the faster option is chosen
    assert result.choice.estimate.option.name == "zero2_offload"
