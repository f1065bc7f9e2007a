"""What the PJRT runtime offers, asked without starting it: whether torch_xla is installed, the configured device
type, how many devices it has, and whether it computes in bfloat16.

torch_xla is imported only inside these functions. Nothing here starts the XLA runtime in the calling process
(``xmp.spawn`` refuses to start workers after that), except where a docstring says so.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = [
    "TESTED_TORCH_XLA_VERSION",
    "check_bf16_supported",
    "device_supports_bf16",
    "pjrt_device_count",
    "pjrt_device_type",
    "torch_xla_install_hint",
    "torch_xla_installed",
    "torch_xla_missing_message",
]

# torch_xla X.Y.Z is built against torch X.Y.Z; this is the pair lightspeed is tested with (scripts/setup_xla.sh)
TESTED_TORCH_XLA_VERSION = "2.9.0"


def torch_xla_install_hint() -> str:
    """How to install torch_xla, the one instruction every message gives: it must match torch's version exactly."""
    torch_version = torch.__version__.split("+")[0]
    return (
        f"torch_xla must match your torch version exactly: with torch {torch_version} run `pip install "
        f"torch_xla=={torch_version}`, or create an environment with the tested pair (torch {TESTED_TORCH_XLA_VERSION} "
        f"and torch_xla {TESTED_TORCH_XLA_VERSION}: `bash scripts/setup_xla.sh`, or `pip install "
        f"torch=={TESTED_TORCH_XLA_VERSION} 'lightspeed[xla]'`)"
    )


def torch_xla_missing_message() -> str:
    """What to install when ``accelerator="xla"`` is asked for without torch_xla."""
    return f"accelerator='xla' needs the `torch_xla` package, which is not installed. {torch_xla_install_hint()}."


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
