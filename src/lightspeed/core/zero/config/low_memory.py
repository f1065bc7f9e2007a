"""Where DeepSpeed runs its low-memory bf16 states (``bf16_master_weights_and_grads``, ``bf16_optimizer_states``).

DeepSpeed 0.19 keeps bf16 master weights with fp32 optimizer moments only in its CPU Adam (the optimizer offloaded to
the CPU), and its NVMe optimizer swapper does not run bf16 master weights at all: its swap buffers are fp32, and the
first step fails on a bare ``assert dtype == self.dtype`` inside ``swap_tensor/utils.py``. The same rule refuses
such a config before anything is built (:func:`check_low_memory_states`) and keeps the planner from choosing such
an option (:func:`low_memory_conflict`).
"""

from __future__ import annotations

from typing import Any

from lightspeed.core.errors import DeepSpeedConfigError

__all__ = ["check_low_memory_states", "low_memory_conflict"]


_ON_NVME = "DeepSpeed's NVMe optimizer swapper does not run bf16 master weights"
_NOT_OFFLOADED = "bf16 master weights with fp32 moments run only with the optimizer offloaded to the CPU"
#: what to change, for each conflict
_ADVICE = {
    _ON_NVME: (
        "bf16_master_weights_and_grads=True with the optimizer states on NVMe: DeepSpeed's optimizer swapper keeps "
        "fp32 swap buffers, and the first step would fail inside DeepSpeed. Offload the optimizer to the CPU instead "
        "(offload_optimizer='cpu', e.g. strategy='zero3_offload'), or keep fp32 master weights."
    ),
    _NOT_OFFLOADED: (
        "bf16_master_weights_and_grads=True without bf16_optimizer_states keeps the optimizer moments in fp32, "
        "which DeepSpeed runs only with the optimizer offloaded (its CPU Adam): pass offload_optimizer='cpu' "
        "(e.g. strategy='zero2_offload'), or bf16_optimizer_states=True to keep everything in bf16."
    ),
}


def low_memory_conflict(offload_optimizer: str, master: bool, states: bool) -> str | None:
    """Why DeepSpeed cannot run bf16 master weights (``master``) and moments (``states``) with the optimizer states
    at ``offload_optimizer`` (``"none"``, ``"cpu"``, ``"nvme"``); None where it can."""
    if master and offload_optimizer == "nvme":
        return _ON_NVME
    if master and not states and offload_optimizer == "none":
        return _NOT_OFFLOADED
    return None


def _section(config: dict[str, Any], key: str) -> dict[str, Any]:
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def check_low_memory_states(config: dict[str, Any]) -> None:
    """Raise :class:`DeepSpeedConfigError`, saying what to change, when DeepSpeed cannot run ``config``'s low-memory
    bf16 states where its optimizer states are (the strategies' arguments and a user's ``bf16`` section alike)."""
    bf16 = _section(config, "bf16")
    offload = _section(_section(config, "zero_optimization"), "offload_optimizer")
    master = bf16.get("bf16_master_weights_and_grads") is True
    states = bf16.get("bf16_optimizer_states") is True
    conflict = low_memory_conflict(str(offload.get("device", "none")), master, states)
    if conflict is not None:
        raise DeepSpeedConfigError(_ADVICE[conflict])
