"""Where NVMe offload swaps to: ``nvme_path=`` or ``$LIGHTSPEED_NVME_PATH``, made absolute, created and checked."""

from __future__ import annotations

import os
from pathlib import Path

from lightspeed.core.errors import DeepSpeedConfigError

#: environment variable naming the NVMe offload directory when ``nvme_path`` is not passed
NVME_PATH_ENV = "LIGHTSPEED_NVME_PATH"


def resolve_nvme_path(nvme_path: str | os.PathLike | None) -> str:
    """The absolute, writable NVMe offload directory from ``nvme_path`` or ``$LIGHTSPEED_NVME_PATH`` (created if
    missing); :class:`DeepSpeedConfigError` naming the fix otherwise."""
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
