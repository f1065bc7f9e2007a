"""``accelerator="xla"``: registration, device counting through PJRT, routing to lightspeed's strategy and precision,
and the errors raised while the Trainer is built.

Tests that need torch_xla skip with the reason printed where it is missing (the main environment); the one about a
missing torch_xla skips where it is installed (the XLA environment).
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest
import torch
from lightning.pytorch.accelerators import AcceleratorRegistry

import lightspeed  # noqa: F401  (registers accelerator="xla")
from _support.trainers import quiet_trainer
from lightspeed.plugins.accelerators.xla import XLAAccelerator, parse_xla_devices
from lightspeed.plugins.precision.xla import DEPRECATED_XLA_ENV_VARS

pytestmark = pytest.mark.xla

HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None
needs_torch_xla = pytest.mark.skipif(
    not HAS_TORCH_XLA,
    reason="needs torch_xla; run scripts/setup_xla.sh and test in .venv-xla "
    "(pytest -m xla tests/plugins tests/strategies)",
)


@pytest.fixture
def pjrt_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PJRT_DEVICE", os.environ.get("PJRT_DEVICE", "CPU"))
    import torch_xla  # noqa: F401


def test_import_lightspeed_registers_xla_as_lightspeeds_accelerator() -> None:
    assert AcceleratorRegistry["xla"]["accelerator"] is XLAAccelerator
    assert AcceleratorRegistry["tpu"]["accelerator"] is not XLAAccelerator  # Lightning's own entry is left alone


@pytest.mark.skipif(HAS_TORCH_XLA, reason="torch_xla is installed here; this error is checked in the main .venv")
def test_accelerator_xla_without_torch_xla_says_what_to_install() -> None:
    version = torch.__version__.split("+")[0]
    expected = (
        "accelerator='xla' needs the `torch_xla` package, which is not installed. torch_xla must match your torch "
        f"version exactly: with torch {version} run `pip install torch_xla=={version}`, or create an environment with "
        "the tested pair (torch 2.9.0 and torch_xla 2.9.0: `bash scripts/setup_xla.sh`, or `pip install torch==2.9.0 "
        "'lightspeed[xla]'`)."
    )
    with pytest.raises(ModuleNotFoundError, match=f"^{re.escape(expected)}$"):
        quiet_trainer(accelerator="xla", devices=1)
    with pytest.raises(ModuleNotFoundError, match=f"^{re.escape(expected)}$"):
        quiet_trainer(strategy="xla_exact")


@pytest.mark.parametrize(
    ("devices", "count", "expected"),
    [(1, 1, 1), ("1", 4, 1), (4, 4, 4), (8, 8, 8), ([2], 4, [2]), ("3", 4, None), ([4], 4, None), (2, 4, None)],
)
def test_devices_are_one_all_or_a_single_index(devices: object, count: int, expected: object) -> None:
    if expected is None:
        with pytest.raises(ValueError, match=rf"is not possible on the PJRT device 'CPU' with {count} device\(s\)"):
            parse_xla_devices(devices, count, "CPU")  # type: ignore[arg-type]
    else:
        assert parse_xla_devices(devices, count, "CPU") == expected  # type: ignore[arg-type]


@needs_torch_xla
def test_devices_are_counted_through_the_pjrt_runtime(pjrt_cpu: None) -> None:
    from torch_xla import runtime as xr

    assert xr.device_type() == "CPU"
    assert XLAAccelerator.auto_device_count() == int(os.environ.get("CPU_NUM_DEVICES", "1"))
    assert XLAAccelerator.is_available()
    trainer = quiet_trainer(accelerator="xla", devices="auto")
    assert trainer.num_devices == XLAAccelerator.auto_device_count() == xr.addressable_runtime_device_count()
    assert trainer.strategy.root_device.type == "xla"


@needs_torch_xla
def test_no_tpu_metadata_call_unless_the_device_is_a_tpu(pjrt_cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.fabric.accelerators.xla import XLAAccelerator as LightningXLAAccelerator
    from torch_xla._internal import tpu

    calls: list[str] = []

    def metadata_call(key: str) -> str:
        calls.append(key)
        raise OSError("no metadata server here")

    monkeypatch.setattr(tpu, "_get_metadata", metadata_call)
    LightningXLAAccelerator.auto_device_count.cache_clear()
    LightningXLAAccelerator.is_available.cache_clear()
    assert LightningXLAAccelerator.is_available() is False  # Lightning's "TPU available" probe, asked on Trainer start
    quiet_trainer(accelerator="xla", devices=1)
    assert XLAAccelerator.auto_device_count() >= 1
    assert calls == []
    # control: the TPU core count Lightning's probe uses does reach the metadata server when asked
    with pytest.raises(OSError, match="no metadata server here"):
        tpu.num_available_devices()
    assert calls == ["tpu-env"]


@needs_torch_xla
@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed", "32-true"])
def test_precision_flag_routes_to_lightspeed_xla_precision(pjrt_cpu: None, precision: str) -> None:
    from lightspeed.plugins import XLAPrecision
    from lightspeed.strategies.xla import SingleDeviceXLAExactStrategy

    before = {k: os.environ.get(k) for k in DEPRECATED_XLA_ENV_VARS}
    trainer = quiet_trainer(accelerator="xla", devices=1, precision=precision)
    assert isinstance(trainer.accelerator, XLAAccelerator)
    assert isinstance(trainer.strategy, SingleDeviceXLAExactStrategy)
    assert type(trainer.precision_plugin) is XLAPrecision
    assert trainer.precision_plugin.precision == precision
    assert {k: os.environ.get(k) for k in DEPRECATED_XLA_ENV_VARS} == before


@needs_torch_xla
def test_downcast_plugin_and_xla_exact_by_name(pjrt_cpu: None) -> None:
    from lightspeed.plugins import XLAPrecision
    from lightspeed.strategies.xla import XLAExactStrategy

    plugin = XLAPrecision("bf16-downcast")
    trainer = quiet_trainer(accelerator="xla", devices=1, strategy="xla_exact", plugins=[plugin])
    assert isinstance(trainer.strategy, XLAExactStrategy)
    assert trainer.precision_plugin is plugin


@needs_torch_xla
def test_unknown_precision_mode_fails_while_building_the_trainer(pjrt_cpu: None) -> None:
    with pytest.raises(ValueError, match=r"^XLAPrecision got an unknown precision mode '16-mixed'\. Choose one of: "):
        quiet_trainer(accelerator="xla", devices=1, precision="16-mixed")


@needs_torch_xla
def test_bf16_on_a_device_without_bf16_fails_while_building_the_trainer(
    pjrt_cpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightspeed.core.xla import runtime as xla_runtime

    monkeypatch.setattr(xla_runtime, "device_supports_bf16", lambda device_type: False)
    expected = (
        "precision 'bf16-true' computes in bfloat16, which the PJRT device 'CPU' does not support. Use "
        "precision='32-true' on this device, or select a device with bfloat16 support through PJRT_DEVICE (TPU, CPU, "
        "or a CUDA GPU of compute capability 8.0 or newer)."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        quiet_trainer(accelerator="xla", devices=1, precision="bf16-true")
    quiet_trainer(accelerator="xla", devices=1, precision="32-true")  # fp32 still fine there


@needs_torch_xla
def test_more_devices_than_pjrt_offers_fails_while_building_the_trainer(pjrt_cpu: None) -> None:
    count = XLAAccelerator.auto_device_count()
    with pytest.raises(
        ValueError, match=rf"^`devices={count + 1}` is not possible on the PJRT device 'CPU' with {count} device"
    ):
        quiet_trainer(accelerator="xla", devices=count + 1)


@needs_torch_xla
@pytest.mark.parametrize("strategy", ["xla_exact", "single_xla_exact"])
def test_xla_exact_strategies_refuse_another_accelerator(pjrt_cpu: None, strategy: str) -> None:
    expected = (
        f"strategy={strategy!r} runs on lightspeed's XLA accelerator, but the accelerator is CPUAccelerator. Pass "
        "`Trainer(accelerator='xla', ...)` as well."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        quiet_trainer(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-true")


def test_other_accelerators_keep_lightnings_own_strategy_and_precision_choice() -> None:
    from lightning.pytorch.plugins import HalfPrecision
    from lightning.pytorch.strategies import SingleDeviceStrategy

    trainer = quiet_trainer(accelerator="cpu", devices=1, precision="bf16-true")
    assert type(trainer.strategy) is SingleDeviceStrategy
    assert type(trainer.precision_plugin) is HalfPrecision
