"""XLAPrecision's casting rules, checked on plain CPU tensors (these run with or without torch_xla)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torchmetrics
from torch import nn

from lightspeed.core.xla.casting import cast_floating_tensors, upcast_metric_updates
from lightspeed.plugins import XLAPrecision
from lightspeed.plugins.precision.xla import DEPRECATED_XLA_ENV_VARS, XLA_PRECISION_MODES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "strategies" / "scripts"))
import xla_model  # noqa: E402  (the shared model module of the XLA tests; holds the expected dtypes)

pytestmark = pytest.mark.xla


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.w64 = nn.Parameter(torch.ones(2, dtype=torch.float64))
        self.register_buffer("b64", torch.zeros(2, dtype=torch.float64))
        self.register_buffer("f16", torch.zeros(2, dtype=torch.float16))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.metric = torchmetrics.MeanSquaredError()


@pytest.mark.parametrize("mode", XLA_PRECISION_MODES)
def test_convert_module_casts_parameters_and_buffers_per_mode(mode: str) -> None:
    module = Mixed()
    values = {k: v.detach().clone() for k, v in module.state_dict().items()}
    assert XLAPrecision(mode).convert_module(module) is module
    f32, p64, b64 = xla_model.EXPECTED_DTYPES[mode]
    assert module.linear.weight.dtype == module.linear.bias.dtype == f32
    assert module.w64.dtype == p64
    assert isinstance(module.w64, nn.Parameter)
    assert module.b64.dtype == b64
    assert module.f16.dtype == torch.float16  # only float32 and float64 are cast
    assert module.count.dtype == torch.int64
    assert module.metric.sum_squared_error.dtype == torch.float32  # metric states are never cast
    for name, before in values.items():  # values survive the cast (to the target dtype's precision)
        assert torch.equal(module.state_dict()[name], before.to(module.state_dict()[name].dtype)), name


@pytest.mark.parametrize("mode", XLA_PRECISION_MODES)
def test_convert_input_casts_floating_batch_tensors_per_mode(mode: str) -> None:
    batch = {
        "x": torch.randn(2, 3),
        "pair": (torch.randn(2, dtype=torch.float64), torch.arange(2)),
        "items": [torch.ones(1, dtype=torch.float16)],
        "name": "not a tensor",
    }
    out = XLAPrecision(mode).convert_input(batch)
    f32, f64, _ = xla_model.EXPECTED_DTYPES[mode] if mode != "bf16-mixed" else (torch.float32, torch.float64, None)
    assert out["x"].dtype == f32
    assert out["pair"][0].dtype == f64
    assert out["pair"][1].dtype == torch.int64
    assert out["items"][0].dtype == torch.float16
    assert out["name"] == "not a tensor"
    assert torch.equal(out["x"], batch["x"].to(f32))


@pytest.mark.parametrize("mode", ["bf16-true", "bf16-downcast", "bf16-mixed"])
def test_convert_output_hands_bfloat16_back_as_float32(mode: str) -> None:
    out = XLAPrecision(mode).convert_output(
        {"pred": torch.ones(2, dtype=torch.bfloat16), "f64": torch.ones(1, dtype=torch.float64)}
    )
    assert out["pred"].dtype == torch.float32
    assert out["f64"].dtype == torch.float64


@pytest.mark.parametrize(
    ("mode", "dtype"),
    [
        ("bf16-true", torch.bfloat16),
        ("bf16-downcast", torch.bfloat16),
        ("bf16-mixed", torch.float32),
        ("32-true", torch.float32),
    ],
)
def test_module_init_context_creates_weights_in_the_mode_dtype(mode: str, dtype: torch.dtype) -> None:
    default = torch.get_default_dtype()
    with XLAPrecision(mode).module_init_context():
        layer = nn.Linear(2, 2)
    assert layer.weight.dtype == dtype
    assert torch.get_default_dtype() == default


def test_unknown_precision_mode_is_rejected_with_the_choices() -> None:
    with pytest.raises(
        ValueError,
        match=r"^XLAPrecision got an unknown precision mode 'fp8'\. Choose one of: 'bf16-true', "
        r"'bf16-downcast', 'bf16-mixed', '32-true' \(`bf16-downcast` is only available as "
        r"`plugins=\[XLAPrecision\('bf16-downcast'\)\]`\)\.$",
    ):
        XLAPrecision("fp8")
    with pytest.raises(ValueError, match="unknown precision mode '16-mixed'"):
        XLAPrecision("16-mixed")


def test_no_mode_touches_the_deprecated_torch_xla_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in DEPRECATED_XLA_ENV_VARS:
        monkeypatch.delenv(key, raising=False)
    before = dict(os.environ)
    for mode in XLA_PRECISION_MODES:
        plugin = XLAPrecision(mode)
        plugin.convert_module(Mixed())
        plugin.convert_input(torch.ones(2))
        with plugin.module_init_context():
            nn.Linear(2, 2)
        plugin.teardown()
    assert dict(os.environ) == before


def test_metric_updates_are_upcast_to_float32() -> None:
    gen = torch.Generator().manual_seed(0)
    preds = torch.randn(64, generator=gen).to(torch.bfloat16)
    target = torch.randn(64, generator=gen).to(torch.bfloat16)
    module = nn.ModuleDict({"mse": torchmetrics.MeanSquaredError()})
    assert upcast_metric_updates(module) == 1
    assert upcast_metric_updates(module) == 0  # not wrapped twice
    module["mse"].update(preds, target)
    expected = torch.mean((preds.float() - target.float()) ** 2)
    assert module["mse"].compute().dtype == torch.float32
    assert torch.equal(module["mse"].compute(), expected)
    # the same update in bfloat16 arithmetic gives a different (less precise) value
    plain = torchmetrics.MeanSquaredError()
    plain.update(preds, target)
    assert not torch.equal(plain.compute(), expected)


def test_cast_floating_tensors_with_an_empty_map_returns_the_batch_itself() -> None:
    batch = [torch.ones(1)]
    assert cast_floating_tensors(batch, {}) is batch
