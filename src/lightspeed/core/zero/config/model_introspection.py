"""Finding a model's hidden size, the scale DeepSpeed's "auto" bucket sizes are derived from."""

from __future__ import annotations

from collections.abc import Mapping

import torch

HIDDEN_SIZE_NAMES = ("hidden_size", "d_model", "n_embd")


def _config_hidden_size(config: object) -> int | None:
    for name in HIDDEN_SIZE_NAMES:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def find_hidden_size(model: torch.nn.Module) -> int | None:
    """The model's hidden size: ``config.hidden_size`` (or ``d_model`` / ``n_embd``) on the model or the first
    submodule that has one (Hugging Face models keep it in ``.config``); otherwise the largest ``in_features`` of
    any ``nn.Linear``; ``None`` when there is neither."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None:
            found = _config_hidden_size(config)
            if found is not None:
                return found
    widths = [m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear) and m.in_features > 0]
    return max(widths) if widths else None
