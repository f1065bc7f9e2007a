"""Parameters ZeRO cannot train as one process does are refused before anything is cast or built, each named with
the fix: float64 (cast to float32 or lower without a word) and 0-dimensional (DeepSpeed's broadcast fails)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.parameter_checks import (
    check_parameters_for_zero,
    check_partitions_kept,
    check_shape_split_groups,
)

FLOAT64 = (
    "{names} {verb} float64, but ZeRO trains float32 parameters (with bf16/fp16 copies under mixed precision): {they} "
    "would be cast without a word and train unlike one process. Make {them} float32 in the model (`.float()`), or "
    "train the model with a strategy that keeps float64 (ddp)."
)
SCALAR = (
    "'logit_scale' is a 0-dimensional parameter, which DeepSpeed cannot broadcast (it fails with 'self.dim() cannot "
    "be 0 to view Float as Byte'). Give each one element: `nn.Parameter(torch.tensor([2.0]))` instead of "
    "`torch.tensor(2.0)` (it broadcasts the same in arithmetic)."
)
PREFIX = "The model has parameters ZeRO cannot train as one process does: "


def test_float32_and_one_element_parameters_pass() -> None:
    model = nn.Linear(3, 2)
    model.scale = nn.Parameter(torch.tensor([2.0]))
    check_parameters_for_zero(model)


def test_a_float64_parameter_is_named() -> None:
    model = nn.Linear(3, 2)
    model.bias = nn.Parameter(model.bias.detach().double())
    with pytest.raises(DeepSpeedConfigError) as raised:
        check_parameters_for_zero(model)
    assert str(raised.value) == PREFIX + FLOAT64.format(names="'bias'", verb="is", they="it", them="it")


def test_many_float64_parameters_are_listed_up_to_five() -> None:
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(4))).double()
    with pytest.raises(DeepSpeedConfigError) as raised:
        check_parameters_for_zero(model)
    names = "'0.weight', '0.bias', '1.weight', '1.bias', '2.weight' and 3 more"
    assert str(raised.value) == PREFIX + FLOAT64.format(names=names, verb="are", they="they", them="them")


def test_a_scalar_parameter_is_named_also_when_zero3_partitioned_it() -> None:
    model = nn.Linear(3, 2)
    model.logit_scale = nn.Parameter(torch.tensor(2.0))
    with pytest.raises(DeepSpeedConfigError) as raised:
        check_parameters_for_zero(model)
    assert str(raised.value) == PREFIX + SCALAR
    partitioned = nn.Module()
    partitioned.logit_scale = nn.Parameter(torch.empty(0))  # a ZeRO-3 partition: flat, its full shape aside
    partitioned.logit_scale.ds_shape = torch.Size([])
    with pytest.raises(DeepSpeedConfigError, match="'logit_scale' is a 0-dimensional parameter"):
        check_parameters_for_zero(partitioned)


def test_both_problems_in_one_error() -> None:
    model = nn.Linear(3, 2).double()
    model.logit_scale = nn.Parameter(torch.tensor(2.0))
    with pytest.raises(DeepSpeedConfigError) as raised:
        check_parameters_for_zero(model)
    names = "'weight', 'bias'"
    wide = FLOAT64.format(names=names, verb="are", they="they", them="them")
    assert str(raised.value) == PREFIX + wide + " " + SCALAR


def _partitioned_mlp() -> nn.Module:
    """Two linear layers as ZeRO-3 leaves them after building under its init context: flat, empty partitions, each
    with its full shape in ``ds_shape``."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    for param in model.parameters():
        param.ds_shape = param.shape
        param.data = torch.empty(0)
    return model


def _nanogpt_groups(model: nn.Module, dims: object = lambda p: p.dim()) -> list[dict]:
    decay = [p for p in model.parameters() if dims(p) >= 2]
    no_decay = [p for p in model.parameters() if dims(p) < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def test_a_weight_decay_split_by_the_partitions_shape_is_refused() -> None:
    model = _partitioned_mlp()
    optimizer = torch.optim.AdamW(_nanogpt_groups(model), lr=1e-3)  # p.dim() is 1 for every partition
    with pytest.raises(DeepSpeedConfigError) as raised:
        check_shape_split_groups(optimizer, model)
    assert str(raised.value) == (
        "Param group 0 of AdamW has weight_decay=0.1 but no parameters, while 2 parameter(s) of two or more "
        "dimensions ('0.weight', '1.weight') are in groups without weight decay. The model was built as ZeRO-3 "
        "partitions (in `configure_model` or under `fabric.init_module()`), so `p.dim()` and `p.shape` see a flat "
        "partition, not the parameter: split by the full shape, `len(getattr(p, 'ds_shape', p.shape)) >= 2`, or by "
        "name."
    )


def test_a_split_by_the_full_shape_and_unpartitioned_models_pass() -> None:
    model = _partitioned_mlp()
    full = torch.optim.AdamW(_nanogpt_groups(model, lambda p: len(p.ds_shape)), lr=1e-3)
    check_shape_split_groups(full, model)
    whole = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))  # not partitioned: p.dim() is the real one
    check_shape_split_groups(torch.optim.AdamW(_nanogpt_groups(whole), lr=1e-3), whole)


def test_parameters_that_lost_their_partition_are_named() -> None:
    model = _partitioned_mlp()
    for param in model.parameters():
        param.ds_id = 0  # partitioned as DeepSpeed leaves them: known to it
    model[1].weight = nn.Parameter(torch.empty(0))  # an empty tensor DeepSpeed knows nothing of
    with pytest.raises(DeepSpeedConfigError) as raised:
        check_partitions_kept(model, "`configure_model`", "in `__init__`")
    assert str(raised.value) == (
        "Parameters 1.weight were built under `configure_model` with ZeRO-3 but lost their partition: they are empty "
        "tensors DeepSpeed knows nothing of, left by a partitioned parameter copied other than with `copy.deepcopy` "
        "(pickled, `copy.copy`) or by a `.data` replaced. Build the model in `__init__` (ZeRO-3 then partitions it "
        "when the engine is built), or create or deep-copy those layers instead."
    )
