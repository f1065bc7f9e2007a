"""The quiet ``L.Trainer`` the tests and their worker scripts build: no logger, checkpoints, progress bar or model
summary, so a run writes nothing it was not asked to and its output holds only what the test reads."""

from __future__ import annotations

from typing import Any

import lightning as L

#: the Trainer arguments of a quiet run; for call sites that collect Trainer arguments in a dict of their own
QUIET: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def quiet_trainer(**overrides: Any) -> L.Trainer:
    """``L.Trainer(**QUIET, **overrides)``, ``overrides`` winning: a run that checkpoints passes
    ``enable_checkpointing=True`` (or a computed value), one that keeps the model summary ``enable_model_summary=True``
    (Lightning's own defaults)."""
    return L.Trainer(**{**QUIET, **overrides})
