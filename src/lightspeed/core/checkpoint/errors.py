"""Errors raised while reading ZeRO checkpoints, writing exports and loading them back.

Both are user errors: the message names the file, tag or key at fault and says what to change, and the
command-line tool turns them into exit code 2 with no traceback.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "ExportError"]


class CheckpointError(ValueError):
    """The checkpoint given is not a readable DeepSpeed ZeRO checkpoint (missing, truncated or mixed files)."""


class ExportError(ValueError):
    """The export cannot be written where asked, or does not fit the module it is loaded into."""
