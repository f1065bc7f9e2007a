"""Find PEFT models (``peft.PeftModel``) inside a module, by duck typing: peft is imported only where it is used.

A PEFT model trains its adapters and keeps the pretrained base frozen, which comes back from the pretrained files on
resume: its checkpoints leave the frozen parameters out by default (``exclude_frozen_parameters="auto"``), and its
exports are written in PEFT's adapter layout.
"""

from __future__ import annotations

from typing import Any

import torch

from lightspeed.core.errors import AdapterTargetError

__all__ = ["adapter_models", "check_adapter_targets", "is_peft_model", "resolve_frozen_exclusion"]


def is_peft_model(module: Any) -> bool:
    """True for a ``peft.PeftModel`` (its ``peft_config`` maps adapter names to configs, ``get_base_model`` exists)."""
    return isinstance(getattr(module, "peft_config", None), dict) and callable(getattr(module, "get_base_model", None))


def adapter_models(module: torch.nn.Module) -> dict[str, Any]:
    """The outermost PEFT models inside ``module`` (itself included), by their module path ('' for ``module``)."""
    found: dict[str, Any] = {}
    for name, sub in module.named_modules():
        if is_peft_model(sub) and not any(name.startswith(f"{outer}.") or outer == "" for outer in found):
            found[name] = sub
    return found


def resolve_frozen_exclusion(choice: bool | str, module: torch.nn.Module) -> bool:
    """``exclude_frozen_parameters`` for a save of ``module``: ``"auto"`` leaves frozen parameters out when the module
    holds a PEFT model (its frozen base comes back from the pretrained files); a bool is taken as given."""
    if choice == "auto":
        return bool(adapter_models(module))
    if not isinstance(choice, bool):
        raise ValueError(f"exclude_frozen_parameters must be True, False or 'auto', got {choice!r}")
    return choice


def _matches(module_name: str, target: str) -> bool:
    """peft's rule for a target given by name: the module's full name, or its last components."""
    return module_name == target or module_name.endswith(f".{target}")


def check_adapter_targets(module: torch.nn.Module) -> None:
    """Raise :class:`AdapterTargetError` when an adapter of a PEFT model inside ``module`` names target modules (a
    list of names) of which some match no module of the base model: peft raises only when none matches, and trains
    the others, so a misspelt name would silently leave layers without adapters. Every rank builds the same model, so
    every rank raises, before the engine is built."""
    for path, peft_model in adapter_models(module).items():
        names = [name for name, _ in peft_model.get_base_model().named_modules()]
        for adapter, config in peft_model.peft_config.items():
            targets = getattr(config, "target_modules", None)
            if isinstance(targets, str) or not targets:  # a regular expression, or none: peft's own rules
                continue
            unmatched = sorted(t for t in targets if not any(_matches(name, t) for name in names))
            if unmatched:
                where = f" at {path!r}" if path else ""
                raise AdapterTargetError(
                    f"The PEFT model{where} has adapter {adapter!r} with target_modules {sorted(targets)}, but "
                    f"{unmatched} match no module of the model; peft would train the others only. Fix the names "
                    "(modules are matched by their name or its last parts, e.g. 'q_proj')."
                )
