"""Generation under ZeRO-3 that cannot hang.

Under ZeRO-3 every forward pass gathers each layer's parameters from all ranks, so every rank must run the same
number of forward passes. Autoregressive generation breaks that as soon as the ranks' sequences end at different steps
(an end-of-sequence token, another ``max_new_tokens``): the rank that stopped leaves the others waiting in a gather
forever. HuggingFace's ``generate`` keeps going with dummy forward passes until every rank is done when it is called
with ``synced_gpus=True``, which users have to know to pass. :func:`keep_generation_in_step` makes it the default for
every ``generate`` method of a model's modules while their parameters are partitioned over several processes, and
refuses ``synced_gpus=False`` there.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["SYNCED_GPUS_FALSE_ERROR", "keep_generation_in_step", "partitioned_over_ranks"]

SYNCED_GPUS_FALSE_ERROR = (
    "`generate(synced_gpus=False)` on a model partitioned by ZeRO-3 over {world} processes: every forward pass gathers "
    "the parameters from all ranks, so a rank whose sequences end earlier than another's leaves it waiting forever. "
    "Drop `synced_gpus` (lightspeed passes synced_gpus=True under ZeRO-3) or pass synced_gpus=True."
)


def partitioned_over_ranks(module: nn.Module) -> bool:
    """True when ``module`` has ZeRO-3 partitioned parameters and runs in a process group of several ranks."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    if torch.distributed.get_world_size() < 2:
        return False
    return any(hasattr(p, "ds_id") for p in module.parameters())


def _takes_synced_gpus(method: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return "synced_gpus" in parameters


def _in_step(module: nn.Module, generate: Callable[..., Any]) -> Callable[..., Any]:
    """``generate`` with ``synced_gpus=True`` while ``module`` is partitioned over ranks, bound to ``module`` as a
    method (Fabric's ``mark_forward_method("generate")`` accepts only methods)."""

    @functools.wraps(generate)
    def generate_in_step(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if partitioned_over_ranks(self):
            if kwargs.get("synced_gpus") is False:
                raise ValueError(SYNCED_GPUS_FALSE_ERROR.format(world=torch.distributed.get_world_size()))
            kwargs["synced_gpus"] = True
        return generate(*args, **kwargs)

    generate_in_step.__lightspeed_in_step__ = True  # type: ignore[attr-defined]
    return types.MethodType(generate_in_step, module)


def keep_generation_in_step(model: nn.Module) -> list[str]:
    """Make every ``generate`` method of ``model``'s modules that takes ``synced_gpus`` (HuggingFace's) pass
    ``synced_gpus=True`` while the module is partitioned over several ranks; returns the names of the modules changed
    (``""`` for ``model`` itself). Idempotent; a module that is no longer partitioned generates as before."""
    changed = []
    for name, module in model.named_modules():
        generate = getattr(module, "generate", None)
        if not callable(generate) or getattr(generate, "__lightspeed_in_step__", False):
            continue
        if not _takes_synced_gpus(generate):
            continue
        module.generate = _in_step(module, generate)
        changed.append(name)
    return changed
