"""The build-time patches of :mod:`lightspeed.core.zero.partitioned_build` in one process: installed only inside the
block (and only when asked), removed afterwards even when nested or left by an error, and transparent to tensors that
are not partitioned ZeRO-3 parameters. Their effect on partitioned parameters is tested under the Trainer and Fabric
(``tests/strategies/test_zero_model_shapes.py``, ``tests/fabric/test_fabric_model_shapes.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightspeed.core.zero.partitioned_build import building_into_partitions, partitioned_parameters_kept_whole

ZERO3 = {"zero_optimization": {"stage": 3}}


def _originals() -> tuple[object, ...]:
    return (
        nn.Parameter.__deepcopy__,
        torch.nn.init.normal_,
        torch.nn.init.xavier_uniform_,
        torch.Tensor.fill_,
        torch.Tensor.copy_,
    )


def test_the_patches_exist_only_inside_the_block_and_nested_blocks_keep_them() -> None:
    before = _originals()
    with partitioned_parameters_kept_whole():
        patched = _originals()
        assert all(a is not b for a, b in zip(before, patched, strict=True))
        with partitioned_parameters_kept_whole():
            assert _originals() == patched
        assert _originals() == patched  # the inner block's exit keeps the outer block's patches
    assert _originals() == before
    assert "fill_" not in torch.Tensor.__dict__  # the method is inherited again, not a copy of it


def test_the_patches_are_removed_when_the_build_fails() -> None:
    before = _originals()
    with pytest.raises(ValueError, match="bad layer"), building_into_partitions(ZERO3, True):
        raise ValueError("bad layer")
    assert _originals() == before


def test_nothing_is_patched_when_the_config_is_not_zero3() -> None:
    before = _originals()
    with building_into_partitions({"zero_optimization": {"stage": 2}}, False):
        assert _originals() == before


def test_tensors_that_are_not_partitioned_behave_as_always_inside_the_block() -> None:
    torch.manual_seed(0)
    want = nn.Linear(4, 3)
    nn.init.orthogonal_(want.weight)
    want.bias.data.fill_(0.5)
    twin_want = copy.deepcopy(want)
    with building_into_partitions(ZERO3, True):
        torch.manual_seed(0)
        got = nn.Linear(4, 3)
        nn.init.orthogonal_(got.weight)
        with torch.no_grad():
            got.bias.fill_(0.5)
        twin = copy.deepcopy(got)
    for a, b in ((got, want), (twin, twin_want)):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert twin.weight is not got.weight and twin.weight.requires_grad
