"""Room on the NVMe offload path, checked before DeepSpeed builds the engine.

DeepSpeed's swappers create their files as the first step runs and fail deep inside a write (or leave a full disk)
when the path has too little room. What goes there is known once the model exists: every rank's partition of the
parameters (in the training dtype) when parameters are offloaded, and, for every trained element of its partition,
the fp32 master weight, the fp32 gradient and the optimizer's moments; the ranks of one node share the path. That
sum, against the free space of the path, is one error on every rank naming the path and both numbers.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from lightspeed.core.common.distributed import raise_on_every_rank
from lightspeed.core.common.sizes import format_size
from lightspeed.core.errors import DeepSpeedConfigError

__all__ = ["OPTIMIZER_STATE_BYTES", "check_nvme_space", "nvme_bytes_needed"]

#: bytes of optimizer moments per trained element (Adam's two fp32 moments, the most common case)
OPTIMIZER_STATE_BYTES = 8
_FP32 = 4


def _offload_sections(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    zero = config.get("zero_optimization") or {}
    return zero.get("offload_param") or {}, zero.get("offload_optimizer") or {}


def nvme_bytes_needed(model: torch.nn.Module, config: dict[str, Any], world_size: int, local_world_size: int) -> int:
    """Bytes the ranks of one node write to the NVMe path for ``model`` under ``config`` (0 without NVMe offload)."""
    params, optimizer = _offload_sections(config)
    total = trained = 0
    element = _FP32
    for param in model.parameters():
        numel = int(getattr(param, "ds_numel", param.numel()))
        total += numel
        element = param.element_size()
        if param.requires_grad:
            trained += numel
    needed = 0.0
    if params.get("device") == "nvme":
        needed += total * element / world_size
    if optimizer.get("device") == "nvme":
        needed += trained * (_FP32 + _FP32 + OPTIMIZER_STATE_BYTES) / world_size
    return int(needed * local_world_size)


def check_nvme_space(model: torch.nn.Module, config: dict[str, Any], world_size: int, local_world_size: int) -> None:
    """Raise :class:`DeepSpeedConfigError` on every rank (a collective where NVMe offload is configured) when a
    node's NVMe path has less free space than its ranks will write there."""
    params, optimizer = _offload_sections(config)
    paths = {section.get("nvme_path") for section in (params, optimizer) if section.get("device") == "nvme"}
    if not paths:
        return
    needed = nvme_bytes_needed(model, config, world_size, local_world_size)
    problem = None
    for path in sorted(str(p) for p in paths if p):
        free = shutil.disk_usage(path).free if os.path.isdir(path) else 0
        if needed > free:
            problem = DeepSpeedConfigError(
                f"NVMe offload path {path!r} has {format_size(free)} free, but this node's {local_world_size} "
                f"process(es) will write about {format_size(needed)} there ({needed} bytes: the parameters and the "
                "fp32 weights, gradients and optimizer moments of the trained ones). Free space there, choose another "
                "path (nvme_path= or LIGHTSPEED_NVME_PATH), or train on more nodes."
            )
            break
    raise_on_every_rank(problem, "checking the NVMe offload path", error_type=DeepSpeedConfigError)
