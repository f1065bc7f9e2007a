"""What the ``lightspeed`` subcommands share about the user's request: the exit codes, the error for a bad
request, and the check that a strategy offloading to NVMe was given its directory."""

from __future__ import annotations

import os

from lightspeed.core.zero.config import NVME_PATH_ENV

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USER_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """A problem with what the user asked for; the command prints the message and exits with code 2."""


def require_nvme_path(strategy: str, nvme_path: str | None) -> None:
    """:class:`UsageError` unless ``--nvme-path`` or ``$LIGHTSPEED_NVME_PATH`` names the NVMe directory."""
    if not (nvme_path or os.environ.get(NVME_PATH_ENV)):
        raise UsageError(
            f"{strategy} offloads to NVMe: pass --nvme-path DIR (a directory on an NVMe drive) or set {NVME_PATH_ENV}."
        )
