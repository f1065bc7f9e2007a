"""DeepSpeed's ZeRO optimizer as a ``torch.optim.Optimizer``, so that torch's learning-rate schedulers accept it.

A loop that builds its scheduler after the engine exists (Fabric: ``StepLR(optimizer)`` on what ``fabric.setup``
returned) hands torch a ZeRO optimizer, which DeepSpeed does not derive from ``torch.optim.Optimizer``; every torch
scheduler then refuses it with ``TypeError: ... is not an Optimizer``. The ZeRO optimizer already has what a scheduler
uses, its ``param_groups`` (the group dictionaries of the optimizer that steps the fp32 master weights, so a learning
rate written there is the one the next step uses) and ``step``; only the base class is missing. :func:`make_schedulable`
adds it to the object's class without touching its behaviour: every DeepSpeed method comes first in the method
resolution order, ``torch.optim.Optimizer`` last.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["make_schedulable"]


_SCHEDULABLE: dict[type, type] = {}


def _schedulable_class(cls: type) -> type:
    """``cls`` with ``torch.optim.Optimizer`` as its last base (one class per DeepSpeed optimizer class)."""
    if cls not in _SCHEDULABLE:
        # __repr__: torch's reads attributes its __init__ sets, which DeepSpeed's optimizer never ran
        namespace = {"__repr__": object.__repr__, "__module__": cls.__module__}
        _SCHEDULABLE[cls] = type(cls.__name__, (cls, torch.optim.Optimizer), namespace)
    return _SCHEDULABLE[cls]


def make_schedulable(optimizer: Any) -> Any:
    """Make ``optimizer`` (DeepSpeed's ZeRO optimizer, in place) an instance of ``torch.optim.Optimizer``; returns
    it. Anything that is one already is returned unchanged."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(f"{type(optimizer).__name__} has no param_groups: a learning-rate scheduler cannot drive it")
    optimizer.__class__ = _schedulable_class(type(optimizer))
    return optimizer
