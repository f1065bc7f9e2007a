"""lightspeed's own logger (``logging.getLogger("lightspeed")``) and its switch, ``LIGHTSPEED_LOG_LEVEL``.

What a run needs to see goes through the front end's rank-zero INFO logger; details (the whole resolved DeepSpeed
config) go to the ``lightspeed`` logger at DEBUG, which stays silent unless asked: ``LIGHTSPEED_LOG_LEVEL=DEBUG`` in the
environment (read at ``import lightspeed``) or ``logging.getLogger("lightspeed").setLevel(logging.DEBUG)`` with a
handler of your own.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["LOG_LEVEL_ENV", "configure_from_environment", "logger"]

#: the environment variable that sets the level of the ``lightspeed`` logger
LOG_LEVEL_ENV = "LIGHTSPEED_LOG_LEVEL"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

logger = logging.getLogger("lightspeed")


def configure_from_environment() -> None:
    """Apply ``LIGHTSPEED_LOG_LEVEL`` (a level name, any case) to the ``lightspeed`` logger, with a handler that
    writes to stderr, once; nothing when it is unset or empty."""
    value = os.environ.get(LOG_LEVEL_ENV, "").strip()
    if not value:
        return
    level = value.upper()
    if level not in _LEVELS:
        raise ValueError(f"{LOG_LEVEL_ENV}={value!r} is not a log level; use one of {', '.join(_LEVELS)}.")
    logger.setLevel(level)
    if not any(getattr(handler, "_lightspeed", False) for handler in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        handler._lightspeed = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
