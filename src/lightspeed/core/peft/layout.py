"""PEFT's adapter layout for an export: ``adapter_model.safetensors`` + ``adapter_config.json``, which
``peft.PeftModel.from_pretrained(base_model, directory)`` loads.

Which tensors an adapter saves and under which names is peft's own decision (``get_peft_model_state_dict``: the
adapter's weights, its ``modules_to_save``, without the adapter's name in the keys). It is asked once, on the live
model, with placeholder tensors standing in for the weights (nothing is gathered), and the answer is kept as a plain
mapping: the live export streams those tensors from the engine, and the same mapping saved in the checkpoint lets
``lightspeed export`` write the layout from the checkpoint files, without peft or the model.
"""

from __future__ import annotations

import copy
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightspeed.core.errors import ExportError
from lightspeed.core.peft.detect import adapter_models

__all__ = ["ADAPTERS_KEY", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "AdapterLayout", "adapter_layouts"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
#: the client-state key a checkpoint keeps its adapter layouts under
ADAPTERS_KEY = "lightspeed_adapters"


@dataclass(frozen=True)
class AdapterLayout:
    """One adapter's export: ``names`` maps each name in ``adapter_model.safetensors`` to the key of the exported
    module's ``state_dict`` it comes from; ``config_json`` is its ``adapter_config.json``; ``folder`` is ``""`` for
    the default adapter, else the adapter's name (peft's own layout for several adapters)."""

    folder: str
    names: dict[str, str]
    config_json: str

    def write_config(self, directory: Path) -> list[str]:
        """Write ``adapter_config.json`` into ``directory``; returns the names written."""
        (directory / ADAPTER_CONFIG).write_text(self.config_json)
        return [ADAPTER_CONFIG]

    def to_state(self) -> dict[str, Any]:
        return {"folder": self.folder, "names": dict(self.names), "config_json": self.config_json}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> AdapterLayout:
        return cls(str(state["folder"]), {str(k): str(v) for k, v in state["names"].items()}, str(state["config_json"]))


def _config_json(peft_model: Any, adapter: str) -> str:
    """``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it: inference mode, the base model named, the
    auto mapping of a custom base model; written by the config's own ``save_pretrained``."""
    config = copy.deepcopy(peft_model.peft_config[adapter])
    config.inference_mode = True
    if getattr(config, "base_model_name_or_path", None) is None:
        config.base_model_name_or_path = getattr(peft_model.get_base_model(), "name_or_path", None) or None
    auto_mapping = None
    if getattr(config, "task_type", None) is None:
        base_class = type(peft_model.get_base_model())
        auto_mapping = {"base_model_class": base_class.__name__, "parent_library": base_class.__module__}
    with tempfile.TemporaryDirectory(prefix="lightspeed-adapter-config-") as scratch:
        config.save_pretrained(scratch, auto_mapping_dict=auto_mapping)
        return (Path(scratch) / ADAPTER_CONFIG).read_text()


def adapter_layouts(module: torch.nn.Module) -> list[AdapterLayout]:
    """The adapter layouts of the one PEFT model inside ``module`` (none: ``[]``), keys relative to ``module``."""
    models = adapter_models(module)
    if not models:
        return []
    if len(models) > 1:
        raise ExportError(
            f"the model holds {len(models)} PEFT models ({', '.join(repr(name) for name in models)}); an adapter "
            "export writes one. Pass peft='full' to export the whole state_dict."
        )
    ((path, peft_model),) = models.items()
    configs: dict[str, Any] = peft_model.peft_config
    from peft import get_peft_model_state_dict

    prefix = f"{path}." if path else ""
    placeholders = {key: torch.empty(0) for key in peft_model.state_dict(keep_vars=True)}
    key_of = {id(value): key for key, value in placeholders.items()}
    layouts = []
    for adapter in configs:
        chosen = get_peft_model_state_dict(
            peft_model, state_dict=placeholders, adapter_name=adapter, save_embedding_layers=False
        )
        unknown = sorted(name for name, value in chosen.items() if id(value) not in key_of)
        if unknown:
            raise ExportError(
                f"adapter {adapter!r} saves tensors that are not weights of the model ({', '.join(unknown[:3])}); "
                "this adapter type cannot be exported from ZeRO partitions. Pass peft='full' to export the whole "
                "state_dict."
            )
        names = {name: prefix + key_of[id(value)] for name, value in chosen.items()}
        folder = "" if adapter == "default" else adapter
        layouts.append(AdapterLayout(folder, names, _config_json(peft_model, adapter)))
    return sorted(layouts, key=lambda layout: layout.folder)  # the default adapter (root folder) first
