"""A copy of a model and of its torch optimizer for a tuner trial, so that the trial never touches the real ones."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch

__all__ = ["copy_module_and_optimizer"]


def copy_module_and_optimizer(module: torch.nn.Module, optimizer: Any) -> tuple[torch.nn.Module, Any]:
    """A deep copy of ``module`` and a new optimizer of ``optimizer``'s class and hyperparameters over the copy's
    parameters, group by group (``optimizer`` None: None). The optimizer's state (none before the first step) is not
    copied."""
    twin = copy.deepcopy(module)
    if optimizer is None:
        return twin, None
    index = {id(param): position for position, param in enumerate(module.parameters())}
    twin_params = list(twin.parameters())
    groups = []
    for group in optimizer.param_groups:
        unknown = [p for p in group["params"] if id(p) not in index]
        if unknown:
            raise ValueError(
                f"The optimizer holds {len(unknown)} parameter(s) that are not the model's; the tuner copies the model "
                "and rebuilds its optimizer, so pass the optimizer of this model's parameters."
            )
        hyper = {key: value for key, value in group.items() if key not in ("params", "initial_lr")}
        groups.append({**hyper, "params": [twin_params[index[id(p)]] for p in group["params"]]})
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    return twin, type(optimizer)(groups, **defaults)
