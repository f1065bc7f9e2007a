"""No training resumes with its optimizer states on NVMe, where DeepSpeed 0.19 does not restore them exactly.

With the optimizer on NVMe DeepSpeed's ``load_checkpoint`` skips its ZeRO checkpoint and only copies the saved swap
files back: a full fine-tune resumed under ``zero3_nvme`` ended 0.15 off the uninterrupted run two steps later, a LoRA
run under Fabric 1.3e-4. A resume that silently continues from other states is worse than none, so such an engine's
``load_checkpoint`` raises (:func:`refuse_nvme_optimizer_resumes`, installed when the engine is built: every way a
front end resumes goes through it), and :func:`refuse_nvme_optimizer_resume` says so early, before a checkpoint is
resharded for loading.
"""

from __future__ import annotations

import os
from typing import Any

from lightspeed.core.errors import CheckpointError

__all__ = ["refuse_nvme_optimizer_resume", "refuse_nvme_optimizer_resumes"]


def _swaps_optimizer_states(engine: Any) -> bool:
    return bool(getattr(getattr(engine, "optimizer", None), "swap_optimizer", False))


def refuse_nvme_optimizer_resume(engine: Any, path: str | os.PathLike[str]) -> None:
    """Raise :class:`CheckpointError` (on every rank alike) when ``engine`` keeps its optimizer states on NVMe: it
    cannot resume from ``path`` exactly."""
    if not _swaps_optimizer_states(engine):
        return
    raise CheckpointError(
        f"Resuming from {str(path)!r} with the optimizer states on NVMe (zero3_nvme): DeepSpeed does not restore "
        "NVMe-swapped optimizer states exactly, so lightspeed refuses rather than continue from other states. The "
        "checkpoint itself is complete: export its weights (`lightspeed export`) to evaluate them or to start a new "
        "run from them; to resume runs exactly, train with the optimizer states in memory or on the CPU (zero3, "
        "zero3_offload)."
    )


def refuse_nvme_optimizer_resumes(engine: Any) -> None:
    """Make ``engine.load_checkpoint`` raise :func:`refuse_nvme_optimizer_resume`'s error where ``engine`` keeps its
    optimizer states on NVMe; nothing otherwise."""
    if not _swaps_optimizer_states(engine):
        return

    def refused(load_dir: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
        refuse_nvme_optimizer_resume(engine, load_dir)

    engine.load_checkpoint = refused
