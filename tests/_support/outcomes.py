"""What a worker script records for the test to read: where a fit started and how many batches it ran, and the
error a call raised, as text."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback


class Steps(Callback):
    """Records the global step of the first training batch (where a resume started) and counts the batches."""

    def __init__(self) -> None:
        self.first_step: int | None = None
        self.batches = 0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.first_step is None:
            self.first_step = trainer.global_step
        self.batches += 1


def error_text(call: Callable[[], object]) -> str:
    """``"<ErrorType>: <message>"`` of what ``call()`` raised, or ``"no error"``."""
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__}: {err}"
    return "no error"
