"""The merged model of a LoRA run: the base model's ``state_dict``, named as the base model (what
``merge_and_unload()`` leaves), with every active adapter folded into the weights it adapts, so that the base model's
own ``from_pretrained`` loads it.

The weights are streamed one at a time by the live export: a layer peft wrapped contributes its base layer's
tensors, and its ``weight`` gets each active adapter's ``get_delta_weight`` (peft's own formula, fan-in/fan-out and
scaling included) added, computed with that layer's adapter weights gathered. LoRA layers only (no DoRA, no LoRA
bias): other adapter types are refused with what to do instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightspeed.core.errors import ExportError
from lightspeed.core.peft.detect import adapter_models

__all__ = ["MergedTensor", "merged_tensors"]


@dataclass(frozen=True)
class MergedTensor:
    """One tensor of the merged model: ``name`` in the base model, ``key`` of the exported module's ``state_dict``
    holding its value before merging, and the peft ``layer`` whose adapters are added to it (None: copied)."""

    name: str
    key: str
    layer: Any = None


def _is_tuner_layer(module: torch.nn.Module) -> bool:
    return callable(getattr(module, "get_base_layer", None)) and hasattr(module, "merged_adapters")


def _check_mergeable(adapter: str, config: Any) -> None:
    problem = None
    if str(getattr(config, "peft_type", "")).removeprefix("PeftType.") != "LORA":
        problem = f"it is a {getattr(config, 'peft_type', type(config).__name__)} adapter, not LoRA"
    elif getattr(config, "use_dora", False):
        problem = "it uses DoRA"
    elif getattr(config, "bias", "none") != "none" or getattr(config, "lora_bias", False):
        problem = "it trains biases"
    if problem:
        raise ExportError(
            f"a merged export folds LoRA weights into the base model's, but adapter {adapter!r} cannot be merged that "
            f"way ({problem}). Export the adapter (peft='adapter'), load it with PeftModel.from_pretrained and call "
            "merge_and_unload()."
        )


def merged_tensors(module: torch.nn.Module) -> tuple[list[MergedTensor], Any]:
    """The tensors of the merged model of the one PEFT model inside ``module`` (keys relative to ``module``) and its
    base model (for its config); ``ExportError`` when there is none, several, or an adapter LoRA cannot merge."""
    models = adapter_models(module)
    if len(models) != 1:
        found = f"{len(models)} PEFT models" if models else "no PEFT model"
        raise ExportError(f"peft='merged' merges the adapters of one PEFT model; the model holds {found}")
    (peft_model,) = models.values()
    for adapter, config in peft_model.peft_config.items():
        _check_mergeable(adapter, config)
    base = peft_model.get_base_model()
    key_of = {id(value): key for key, value in module.state_dict(keep_vars=True).items()}
    tensors: list[MergedTensor] = []
    inside_layer: set[str] = set()
    for name, sub in base.named_modules():
        if any(name.startswith(f"{layer}.") for layer in inside_layer):
            continue
        layer = None
        source = sub
        if _is_tuner_layer(sub):
            inside_layer.add(name)
            layer, source = sub, sub.get_base_layer()
        dot = f"{name}." if name else ""
        for local, value in source.state_dict(keep_vars=True).items() if layer is not None else _own_tensors(sub):
            if id(value) not in key_of:  # not saved by the module's state_dict: not part of the merged model either
                continue
            tensors.append(MergedTensor(dot + local, key_of[id(value)], layer if local == "weight" else None))
    return tensors, base


def _own_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's own parameters and persistent buffers (not its children's)."""
    owned: list[tuple[str, torch.Tensor]] = [
        (name, param) for name, param in module._parameters.items() if param is not None
    ]
    owned += [
        (name, buffer)
        for name, buffer in module._buffers.items()
        if buffer is not None and name not in module._non_persistent_buffers_set
    ]
    return owned
