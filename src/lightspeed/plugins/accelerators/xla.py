"""``accelerator="xla"``: any PJRT device (TPU, CUDA, CPU, ...), counted through the PJRT runtime.

Lightning's own XLA accelerator counts TPU chips and asks the TPU metadata server for the TPU version, even when
``PJRT_DEVICE=CPU``, so it cannot start outside a TPU VM. This one asks torch_xla which PJRT device is configured and
counts that device's devices without a network call (TPU topology is only queried when the device is a TPU), and
without starting the XLA runtime in the launching process, which would make ``xmp.spawn`` refuse to start workers.

It subclasses Lightning's ``XLAAccelerator`` so that Lightning treats it as an XLA accelerator everywhere (XLA
strategies, ``no_grad`` evaluation loops, checkpoint loading).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any, Union

import torch
from lightning.fabric.accelerators.xla import XLAAccelerator as _FabricXLAAccelerator
from lightning.fabric.utilities.device_parser import _check_data_type
from lightning.pytorch.accelerators.xla import XLAAccelerator as _LightningXLAAccelerator

# torch_xla X.Y.Z is built against torch X.Y.Z; this is the pair lightspeed is tested with (scripts/setup_xla.sh)
TESTED_TORCH_XLA_VERSION = "2.9.0"


def torch_xla_missing_message() -> str:
    """What to install when ``accelerator="xla"`` is asked for without torch_xla."""
    torch_version = torch.__version__.split("+")[0]
    return (
        "accelerator='xla' needs the `torch_xla` package, which is not installed. torch_xla must match your torch "
        f"version exactly: with torch {torch_version} run `pip install torch_xla=={torch_version}`, or install the "
        f"tested pair `pip install torch=={TESTED_TORCH_XLA_VERSION} torch_xla=={TESTED_TORCH_XLA_VERSION}`."
    )


def torch_xla_installed() -> bool:
    """Whether torch_xla can be imported (checked without importing it)."""
    return importlib.util.find_spec("torch_xla") is not None


def pjrt_device_type() -> str | None:
    """The configured PJRT device type (``"TPU"``, ``"CPU"``, ``"CUDA"``, ...), or ``None`` without torch_xla.

    torch_xla picks a default (TPU if one is attached, else CPU) at import when ``PJRT_DEVICE`` is unset.
    """
    if not torch_xla_installed():
        return None
    from torch_xla import runtime as xr

    return xr.device_type()


def _runtime_started() -> bool:
    import torch_xla

    return bool(torch_xla._XLAC._xla_runtime_is_initialized())


def pjrt_device_count() -> int:
    """Number of devices of the configured PJRT device type on this host; 0 without torch_xla.

    Once the XLA runtime runs in this process the runtime itself is asked. Before that the count comes from the same
    sources the runtime will use, so that nothing here starts the runtime (``xmp.spawn`` refuses to run after that):
    ``CPU_NUM_DEVICES`` for CPU, the device plugin for plugin devices (CUDA), PCI and TPU topology for TPUs.
    """
    device = pjrt_device_type()
    if device is None:
        return 0
    from torch_xla import runtime as xr

    if _runtime_started():
        return xr.addressable_runtime_device_count() * xr.local_process_count()
    from torch_xla.experimental import plugins

    if plugins.using_dynamic_plugins():
        return int(plugins.default().physical_chip_count())
    if device == "CPU":
        return int(os.environ.get("CPU_NUM_DEVICES", "1"))
    if device == "TPU":
        from torch_xla._internal import tpu

        return int(tpu.num_available_devices())
    if device == "NEURON":
        from torch_xla._internal import neuron

        return int(neuron.num_local_processes())
    if device in ("CUDA", "GPU"):
        visible = os.environ.get("GPU_NUM_DEVICES")
        return int(visible) if visible else torch.cuda.device_count()
    # an unknown device type: ask the runtime (this starts it in this process)
    return int(xr.addressable_runtime_device_count())


def device_supports_bf16(device_type: str | None) -> bool | None:
    """Whether the PJRT device computes in bfloat16: ``True``/``False``, or ``None`` when only the runtime can tell.

    TPU, CPU and Neuron devices always do. For other devices the answer needs the runtime; it is only asked when it
    already runs here (asking would start it before ``xmp.spawn``); the strategy asks again inside each worker.
    """
    if device_type in ("TPU", "CPU", "NEURON"):
        return True
    if device_type is None:
        return False
    if _runtime_started():
        from torch_xla import runtime as xr

        return bool(xr.is_bf16_supported())
    return None


def check_bf16_supported(precision: str, device_type: str | None, supported: bool | None) -> None:
    """Raise if ``precision`` computes in bfloat16 and ``supported`` says the device cannot."""
    if precision == "32-true" or supported is not False:
        return
    raise ValueError(
        f"precision {precision!r} computes in bfloat16, which the PJRT device {device_type!r} does not support."
        " Use precision='32-true' on this device, or select a device with bfloat16 support through PJRT_DEVICE"
        " (TPU, CPU, or a CUDA GPU of compute capability 8.0 or newer)."
    )


def _parse_devices_str(devices: str) -> Union[int, list[int]]:
    devices = devices.strip()
    try:
        return int(devices)
    except ValueError:
        try:
            return [int(x.strip()) for x in devices.split(",") if x.strip()]
        except ValueError:
            raise ValueError(
                f"Could not parse the XLA devices {devices!r}: pass 'auto', a number, or one device index."
            ) from None


def parse_xla_devices(devices: Union[int, str, list[int]], device_count: int, device_type: str | None) -> Union[int, list[int]]:
    """Validate ``devices`` for XLA: 1, all ``device_count`` devices, or one device index (what xmp.spawn can run)."""
    _check_data_type(devices)
    if isinstance(devices, str):
        devices = _parse_devices_str(devices)
    if isinstance(devices, int) and devices in {1, device_count}:
        return devices
    if isinstance(devices, (list, tuple)) and len(devices) == 1 and 0 <= devices[0] < device_count:
        return list(devices)
    raise ValueError(
        f"`devices={devices!r}` is not possible on the PJRT device {device_type!r} with {device_count} device(s):"
        f" XLA runs on 1 device or on all {device_count}, or on one chosen device [i] with 0 <= i < {device_count}."
        f" To use fewer devices, limit them for torch_xla ({device_type}_NUM_DEVICES, or TPU_VISIBLE_CHIPS on TPUs)."
    )


class XLAAccelerator(_LightningXLAAccelerator):
    """Accelerator for whatever PJRT device torch_xla is configured for (``PJRT_DEVICE``: TPU, CUDA, CPU, ...).

    Registered as ``accelerator="xla"`` by ``import lightspeed``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not torch_xla_installed():
            raise ModuleNotFoundError(torch_xla_missing_message())
        if pjrt_device_type() is None:
            raise RuntimeError(
                "torch_xla has no PJRT device configured. Set the environment variable PJRT_DEVICE (TPU, CUDA or CPU)"
                " before creating the Trainer."
            )
        super().__init__(*args, **kwargs)

    @property
    def device_type(self) -> str | None:
        """The PJRT device type this accelerator runs on."""
        return pjrt_device_type()

    @staticmethod
    def parse_devices(devices: Union[int, str, list[int]]) -> Union[int, list[int]]:
        return parse_xla_devices(devices, XLAAccelerator.auto_device_count(), pjrt_device_type())

    @staticmethod
    def get_parallel_devices(devices: Union[int, list[int]]) -> list[torch.device]:
        devices = XLAAccelerator.parse_devices(devices)
        if isinstance(devices, int):
            return [torch.device("xla", i) for i in range(devices)]
        return [torch.device("xla", devices[0])]

    @staticmethod
    def auto_device_count() -> int:
        """Devices of the configured PJRT device type on this host (no TPU metadata call unless it is a TPU)."""
        return pjrt_device_count()

    @staticmethod
    def is_available() -> bool:
        try:
            return pjrt_device_count() > 0
        except (ValueError, AssertionError, OSError, RuntimeError):
            return False

    @staticmethod
    def name() -> str:
        return "xla"

    @classmethod
    def register_accelerators(cls, accelerator_registry: Any) -> None:
        accelerator_registry.register(cls.name(), cls, description=cls.__name__, override=True)


def _tpu_only_device_count(original: Any) -> Any:
    @functools.lru_cache(maxsize=1)
    def auto_device_count() -> int:
        """Lightning's TPU count, asked only when the PJRT device is a TPU (no metadata call elsewhere)."""
        if pjrt_device_type() != "TPU":
            return 0
        return original()

    auto_device_count._lightspeed_tpu_only = True  # type: ignore[attr-defined]
    return auto_device_count


def quiet_lightning_tpu_probe() -> None:
    """Stop Lightning's TPU probe from calling the TPU metadata server when the PJRT device is not a TPU.

    Lightning asks ``XLAAccelerator.is_available()`` on every Trainer start when torch_xla is installed (to log
    "TPU available"); that counts TPU cores through ``tpu.version()``, an HTTP call to the GCE metadata server. With
    this in place the call only happens when ``PJRT_DEVICE`` is ``TPU``. Idempotent.
    """
    current = _FabricXLAAccelerator.__dict__["auto_device_count"]
    function = current.__func__ if isinstance(current, staticmethod) else current
    if getattr(function, "_lightspeed_tpu_only", False):
        return
    original = getattr(function, "__wrapped__", function)
    _FabricXLAAccelerator.auto_device_count = staticmethod(_tpu_only_device_count(original))  # type: ignore[method-assign]
    is_available = _FabricXLAAccelerator.__dict__["is_available"]
    is_available = is_available.__func__ if isinstance(is_available, staticmethod) else is_available
    if hasattr(is_available, "cache_clear"):
        is_available.cache_clear()
