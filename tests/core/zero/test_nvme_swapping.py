"""NVMe swap sizes taken from the model (``core/zero/nvme_swapping.py``) and the bucket sizes a config resolved before
the model was built takes from it afterwards (``core/zero/config/resolution.py``). The memory they save is measured
by tests/strategies/test_zero_nvme_memory_cap.py (a real cap) and the swapper's growth during a partitioned build by
every zero3_nvme run that builds in ``configure_model`` (tests/strategies/test_zero_lora.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.config import AUTO, zero_preset
from lightspeed.core.zero.config.resolution import fill_sizes_from_the_model, sizes_waiting_for_the_model
from lightspeed.core.zero.nvme_swapping import (
    largest_partition,
    lightspeed_parameter_swapper,
    parameters_held_at_once,
    size_nvme_swapping,
)


class Block(nn.Module):
    """A module with a parameter of its own around a child: both are gathered while the child runs."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.proj = nn.Linear(8, 8)  # weight and bias

    def forward(self, x: Any) -> Any:
        return self.proj(x) * self.scale


def model() -> nn.Module:
    return nn.Sequential(nn.Embedding(101, 8), Block(), Block(), nn.Linear(8, 101, bias=False))


def nvme_config(**zero: Any) -> dict[str, Any]:
    config = zero_preset(3, "nvme", "nvme", nvme_path="/nvme")
    config["zero_optimization"].update(zero)
    return config


def test_the_largest_partition_and_the_parameters_held_at_once() -> None:
    assert largest_partition(model(), world_size=2) == 404  # the 101 x 8 embedding, halved
    assert largest_partition(model(), world_size=3) == 270  # rounded up, as DeepSpeed pads
    assert parameters_held_at_once(model()) == 3  # Block.scale, then proj.weight and proj.bias
    leaf = model()
    leaf[1]._z3_leaf = True  # a ZeRO-3 leaf module gathers everything below it on entry
    assert parameters_held_at_once(leaf) == 3
    assert parameters_held_at_once(nn.ReLU()) == 1


def test_nvme_sizes_are_taken_from_the_model_where_the_config_leaves_them_out() -> None:
    config = nvme_config()
    size_nvme_swapping(config, model(), world_size=2)
    zero = config["zero_optimization"]
    assert zero["offload_param"] | {"nvme_path": None} == {
        "device": "nvme",
        "pin_memory": True,
        "nvme_path": None,
        "max_in_cpu": 0,
        "buffer_size": 404,
        "buffer_count": 4,
    }
    assert zero["stage3_max_reuse_distance"] == 0 and zero["sub_group_size"] == 1


def test_the_users_values_are_kept_and_a_buffer_too_small_is_refused_before_deepspeed_asserts() -> None:
    config = nvme_config(sub_group_size=100, stage3_max_reuse_distance=5)
    config["zero_optimization"]["offload_param"].update(max_in_cpu=10, buffer_count=7)
    size_nvme_swapping(config, model(), world_size=2)
    zero = config["zero_optimization"]
    assert (zero["sub_group_size"], zero["stage3_max_reuse_distance"]) == (100, 5)
    offload = zero["offload_param"]
    # a sub-group closes once it reaches 100 elements: up to 100 + 404 - 1, and the fp16 buffers initialise it
    assert (offload["max_in_cpu"], offload["buffer_count"], offload["buffer_size"]) == (10, 7, 503)

    small = nvme_config()
    small["zero_optimization"]["offload_param"]["buffer_size"] = 400
    with pytest.raises(DeepSpeedConfigError) as error:
        size_nvme_swapping(small, model(), world_size=2)
    assert str(error.value) == (
        "offload_param.buffer_size=400 cannot hold the model's largest parameter partition (or optimizer sub-group) "
        "of 404 elements: DeepSpeed would fail while building the model. Leave buffer_size out (lightspeed sizes it "
        "from the model) or set it to at least 404."
    )


@pytest.mark.parametrize(
    ("stage", "optimizer", "parameters", "added"),
    [
        (3, "cpu", "cpu", {}),
        (3, "nvme", "cpu", {"sub_group_size": 1}),  # the optimizer swapper's buffers follow the sub-group
        (2, "cpu", "none", {}),
    ],
)
def test_only_what_nvme_swaps_is_sized(stage: int, optimizer: str, parameters: str, added: dict[str, Any]) -> None:
    config = zero_preset(stage, optimizer, parameters, nvme_path="/nvme" if "nvme" in (optimizer, parameters) else None)
    before = copy.deepcopy(config)
    size_nvme_swapping(config, model(), world_size=2)
    before["zero_optimization"].update(added)
    assert config == before


def test_bucket_sizes_resolved_before_the_model_was_built_are_taken_from_it_afterwards() -> None:
    config = zero_preset(3)
    assert config["zero_optimization"]["reduce_bucket_size"] == AUTO
    waiting = sizes_waiting_for_the_model(config)
    assert waiting == ["reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"]
    resolved = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 7}}  # one set by the user meanwhile
    assert fill_sizes_from_the_model(resolved, waiting, hidden=64) == [
        "reduce_bucket_size",
        "stage3_param_persistence_threshold",
    ]
    assert resolved["zero_optimization"] == {
        "stage": 3,
        "stage3_prefetch_bucket_size": 7,
        "reduce_bucket_size": 64 * 64,
        "stage3_param_persistence_threshold": 640,
    }
    explicit = zero_preset(3, reduce_bucket_size=1000, prefetch_bucket_size=10, param_persistence_threshold=0)
    assert sizes_waiting_for_the_model(explicit) == []


def user_sized_nvme_config() -> dict[str, Any]:
    config = nvme_config()
    config["zero_optimization"]["offload_param"]["buffer_size"] = 10**6
    return config


@pytest.mark.parametrize(
    ("config", "kind"),
    [
        (nvme_config(), "growing"),
        (user_sized_nvme_config(), "once"),  # the user's buffer size is kept
        (zero_preset(3, "cpu", "cpu"), None),
        ({**nvme_config(), "aio": {"use_gds": True}}, None),  # GPUDirect Storage keeps its buffers on the GPU
    ],
)
def test_zero_init_gets_lightspeeds_swapper_where_parameters_are_on_nvme(
    config: dict[str, Any], kind: str | None
) -> None:
    from deepspeed.runtime.zero import partition_parameters

    original = partition_parameters.AsyncPartitionedParameterSwapper
    with lightspeed_parameter_swapper(config):
        during = partition_parameters.AsyncPartitionedParameterSwapper
    assert partition_parameters.AsyncPartitionedParameterSwapper is original
    assert (during is original) == (kind is None)
    if kind is not None:
        assert issubclass(during, original) and during.swap_in is not original.swap_in  # each parameter once
        assert hasattr(during, "resize") == (kind == "growing")
