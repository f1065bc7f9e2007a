"""Pointing DeepSpeed at the right device family without the user setting ``DS_ACCELERATOR``.

DeepSpeed picks its accelerator once (CUDA when it sees one, otherwise CPU) and caches it. Lightning users choose
the device with ``Trainer(accelerator=...)``; these helpers make DeepSpeed agree with that choice in the launching
process (through the environment, inherited by every rank) and inside each rank (through DeepSpeed's API, in case
DeepSpeed was imported before the choice was known).
"""

from __future__ import annotations

import os
from pathlib import Path

DEVICE_KINDS = ("cpu", "cuda")
#: environment variable naming the NVMe offload directory when ``nvme_path`` is not passed
NVME_PATH_ENV = "LIGHTSPEED_NVME_PATH"


def export_deepspeed_accelerator(kind: str) -> None:
    """Set ``DS_ACCELERATOR`` so that ranks started from this process pick ``kind`` (``"cpu"`` or ``"cuda"``)."""
    if kind not in DEVICE_KINDS:
        raise ValueError(f"DeepSpeed device kind must be one of {DEVICE_KINDS}, got {kind!r}.")
    os.environ["DS_ACCELERATOR"] = kind


def use_deepspeed_accelerator(kind: str) -> None:
    """Make DeepSpeed's cached accelerator ``kind`` in this process; a no-op when it already is.

    On CPU this never touches CUDA: DeepSpeed's CPU accelerator is built directly.
    """
    export_deepspeed_accelerator(kind)
    from deepspeed.accelerator import real_accelerator

    current = real_accelerator.ds_accelerator
    if current is not None and current._name == kind:
        return
    if kind == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        real_accelerator.set_accelerator(CPU_Accelerator())
    else:
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

        real_accelerator.set_accelerator(CUDA_Accelerator())


def deepspeed_device_rank(device_index: int | None, local_rank: int) -> int:
    """The ``device_rank`` DeepSpeed's engine expects: the CUDA index, or the local rank on CPU (never None)."""
    return local_rank if device_index is None else device_index


def async_io_problem() -> str | None:
    """Why NVMe offload cannot run here (DeepSpeed's async_io op), or None when it can."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if AsyncIOBuilder().is_compatible(verbose=False):
            return None
    except Exception as err:  # noqa: BLE001 - any import/build probe failure means "not usable"
        return f"DeepSpeed's async_io op cannot be loaded ({err})."
    return (
        "DeepSpeed's async_io op is not available: it needs the libaio development files. "
        "Install them with `apt-get install libaio-dev` (Debian/Ubuntu) and run again."
    )


def resolve_nvme_path(nvme_path: str | os.PathLike | None) -> str:
    """The absolute, writable NVMe offload directory from ``nvme_path`` or ``$LIGHTSPEED_NVME_PATH`` (created if
    missing); :class:`DeepSpeedConfigError` naming the fix otherwise."""
    from lightspeed.core.deepspeed_config import DeepSpeedConfigError

    path = nvme_path if nvme_path is not None else os.environ.get(NVME_PATH_ENV)
    if not path:
        raise DeepSpeedConfigError(
            "NVMe offload needs a directory on a fast local disk: pass `ZeroStrategy(nvme_path=...)` or set the "
            f"environment variable {NVME_PATH_ENV}."
        )
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DeepSpeedConfigError(
            f"NVMe offload path {str(path)!r} cannot be created ({err.strerror}). Choose a writable directory via "
            f"`nvme_path=` or {NVME_PATH_ENV}."
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise DeepSpeedConfigError(
            f"NVMe offload path {str(path)!r} is not writable. Choose a writable directory via `nvme_path=` or "
            f"{NVME_PATH_ENV}."
        )
    return str(path.resolve())
