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
from typing import Any

import torch
from lightning.fabric.accelerators.xla import XLAAccelerator as _FabricXLAAccelerator
from lightning.fabric.utilities.device_parser import _check_data_type
from lightning.pytorch.accelerators.xla import XLAAccelerator as _LightningXLAAccelerator
from typing_extensions import override

from lightspeed.core.xla.runtime import (
    pjrt_device_count,
    pjrt_device_type,
    torch_xla_installed,
    torch_xla_missing_message,
)

__all__ = ["XLAAccelerator"]


def _parse_devices_str(devices: str) -> int | list[int]:
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


def parse_xla_devices(devices: int | str | list[int], device_count: int, device_type: str | None) -> int | list[int]:
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

    Args:
        *args: passed to Lightning's ``XLAAccelerator``, which takes none.
        **kwargs: passed to Lightning's ``XLAAccelerator``, which takes none.
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
    @override
    def parse_devices(devices: int | str | list[int]) -> int | list[int]:
        return parse_xla_devices(devices, XLAAccelerator.auto_device_count(), pjrt_device_type())

    @staticmethod
    @override
    def get_parallel_devices(devices: int | list[int]) -> list[torch.device]:
        devices = XLAAccelerator.parse_devices(devices)
        if isinstance(devices, int):
            return [torch.device("xla", i) for i in range(devices)]
        return [torch.device("xla", devices[0])]

    @staticmethod
    @override
    def auto_device_count() -> int:  # type: ignore[override]  # Lightning's is an lru_cache wrapper
        """Devices of the configured PJRT device type on this host (no TPU metadata call unless it is a TPU)."""
        return pjrt_device_count()

    @staticmethod
    @override
    def is_available() -> bool:  # type: ignore[override]  # Lightning's is an lru_cache wrapper
        try:
            return pjrt_device_count() > 0
        except (ValueError, AssertionError, OSError, RuntimeError):
            return False

    @staticmethod
    @override
    def name() -> str:
        return "xla"


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
    _FabricXLAAccelerator.auto_device_count = staticmethod(_tpu_only_device_count(original))  # type: ignore[method-assign,assignment]
    is_available = _FabricXLAAccelerator.__dict__["is_available"]
    is_available = is_available.__func__ if isinstance(is_available, staticmethod) else is_available
    if hasattr(is_available, "cache_clear"):
        is_available.cache_clear()
