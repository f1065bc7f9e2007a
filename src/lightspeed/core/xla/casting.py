"""Casting by dtype map: floating tensors of a collection, a module's parameters and buffers (metrics excepted), and
torchmetrics inputs upcast to float32. What precision done by casting (not by environment variables) is made of."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torchmetrics import Metric

__all__ = ["cast_floating_tensors", "cast_module_tensors", "upcast_metric_updates"]


def cast_floating_tensors(data: Any, cast_map: Mapping[torch.dtype, torch.dtype]) -> Any:
    """Cast every tensor in the collection ``data`` whose dtype is a key of ``cast_map`` to the mapped dtype."""
    if not cast_map:
        return data

    def _cast(tensor: Tensor) -> Tensor:
        target = cast_map.get(tensor.dtype)
        return tensor if target is None else tensor.to(target)

    return apply_to_collection(data, Tensor, _cast)


def cast_module_tensors(module: Module, cast_map: Mapping[torch.dtype, torch.dtype]) -> Module:
    """Cast parameters and buffers of ``module`` in place according to ``cast_map``.

    torchmetrics metrics inside the module are left alone: their states accumulate in their own dtype.
    """
    if not cast_map:
        return module
    metric_ids = {id(m) for m in module.modules() if isinstance(m, Metric)}
    skipped: set[int] = set()
    for sub in module.modules():
        if id(sub) in metric_ids or id(sub) in skipped:
            skipped.update(id(m) for m in sub.modules())
            continue
        for param in sub.parameters(recurse=False):
            target = cast_map.get(param.dtype)
            if target is not None:
                param.data = param.data.to(target)
                if param.grad is not None:
                    param.grad = param.grad.to(target)
        for name, buffer in sub.named_buffers(recurse=False):
            target = cast_map.get(buffer.dtype)
            if target is not None:
                sub._buffers[name] = buffer.to(target)
    return module


def _upcast_metric_inputs(update: Callable[..., Any]) -> Callable[..., Any]:
    def update_in_float32(*args: Any, **kwargs: Any) -> Any:
        upcast = {torch.bfloat16: torch.float32, torch.float16: torch.float32}
        return update(*cast_floating_tensors(args, upcast), **cast_floating_tensors(kwargs, upcast))

    update_in_float32.__wrapped__ = update  # type: ignore[attr-defined]
    update_in_float32._lightspeed_upcast = True  # type: ignore[attr-defined]
    return update_in_float32


def upcast_metric_updates(module: Module) -> int:
    """Make every torchmetrics metric in ``module`` receive float32 instead of bfloat16/float16 inputs.

    Returns how many metrics were wrapped (already wrapped ones are not wrapped twice).
    """
    wrapped = 0
    for sub in module.modules():
        if isinstance(sub, Metric) and not getattr(sub.update, "_lightspeed_upcast", False):
            sub.update = _upcast_metric_inputs(sub.update)  # type: ignore[method-assign]
            wrapped += 1
    return wrapped
