"""``zero_auto``'s own keyword arguments (the memory plan and the tuner), declared once for every front end as
:mod:`lightspeed.core.zero.config.arguments` declares the ZeRO ones: a typed dict the front ends unpack
(``**arguments: Unpack[...]``) and the defaults :func:`zero_auto_arguments` fills in."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from typing_extensions import TypedDict

from lightspeed.core.zero.planner import DEFAULT_SAFETY_MARGIN

__all__ = ["ZERO_AUTO_DEFAULTS", "ZeroAutoKeywords", "split_zero_auto_arguments"]


class ZeroAutoKeywords(TypedDict, total=False):
    """What ``zero_auto`` plans and tunes with; every one may be left out (its default in brackets).

    Attributes:
        safety_margin: fraction of every memory budget kept free for activations, buffers and fragmentation [0.2].
        device_memory: memory per device to plan with (bytes or a size like ``"24GB"``) instead of the free memory
            measured on the GPUs; on the CPU the processes share host memory, so leave it unset [None].
        host_memory: host memory per node to plan with instead of what is available now [None].
        nvme_path: allows NVMe offload (as the last resort) into this directory; None: ``$LIGHTSPEED_NVME_PATH``
            [None].
        optimizer_state_bytes: optimizer state per parameter (8: Adam/AdamW; 4: SGD with momentum) [8].
        config: a DeepSpeed config merged over the chosen preset; it must not set the stage or offload targets
            [None].
        tune: measure the options that fit (``tune_steps`` steps each after one warm-up step, on copies of the model
            and optimizer and the run's first batches, in this run's processes) and choose the fastest; logs a table
            of samples/s and peak memory. The run afterwards equals an untuned run with the chosen config bit for
            bit. The Trainer tunes in ``fit`` only; Fabric at ``fabric.setup``, with ``tune_batches`` and
            ``tune_loss``. The copies need room for a second copy of the model while they run [False].
        tune_steps: measured optimizer steps per candidate (each of the run's accumulated micro-batches) [3].
        tune_options: the option names to try (e.g. ``["zero2", "zero3"]``); None: every option that fits [None].
        tune_buckets: also try DeepSpeed's own bucket sizes for each option [False].
        tune_micro_batches: micro-batch sizes the tuner may also try (e.g. ``[4, 8, 16]``), each with the
            accumulation that keeps the samples per optimizer step (so it must divide ``batch_size x`` the
            accumulation). Under the Trainer a size that wins re-batches the training DataLoader (it must be built
            with ``batch_size=``) and sets ``trainer.accumulate_grad_batches``; the run then equals an untuned run
            with that batch size and accumulation. Fabric's loop owns its DataLoader and accumulation, so there the
            fastest size is reported (logged, and as ``tuned_micro_batch`` / ``tuned_accumulation``) for the loop
            to use. The DeepSpeed config must leave the batch sizes ``"auto"`` [None].
        tune_cache: the JSON file of decisions (None: ``~/.cache/lightspeed/zero_tune.json``); a decision is reused
            only for the same model shapes, world size, precision, micro-batch size, hardware and candidates [None].
        retune: measure even when the cache holds a decision [False].
    """

    safety_margin: float
    device_memory: int | str | None
    host_memory: int | str | None
    nvme_path: str | os.PathLike[str] | None
    optimizer_state_bytes: int
    config: str | os.PathLike[str] | dict[str, Any] | None
    tune: bool
    tune_steps: int
    tune_options: Sequence[str] | None
    tune_buckets: bool
    tune_micro_batches: Sequence[int] | None
    tune_cache: str | os.PathLike[str] | None
    retune: bool


#: every :class:`ZeroAutoKeywords` argument's default
ZERO_AUTO_DEFAULTS: Mapping[str, Any] = {
    "safety_margin": DEFAULT_SAFETY_MARGIN,
    "device_memory": None,
    "host_memory": None,
    "nvme_path": None,
    "optimizer_state_bytes": 8,
    "config": None,
    "tune": False,
    "tune_steps": 3,
    "tune_options": None,
    "tune_buckets": False,
    "tune_micro_batches": None,
    "tune_cache": None,
    "retune": False,
}


def split_zero_auto_arguments(given: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``zero_auto``'s own arguments (every one, at its default where left out) and the rest of ``given``, which go
    on to the ZeRO strategy."""
    own = {name: given.get(name, default) for name, default in ZERO_AUTO_DEFAULTS.items()}
    return own, {name: value for name, value in given.items() if name not in ZERO_AUTO_DEFAULTS}
