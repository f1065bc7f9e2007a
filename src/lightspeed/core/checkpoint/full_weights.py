"""Which tensors of a consolidated weights file are the model's: the file a front end loads with
``load_full_weights=True`` may be lightspeed's safetensors export, a checkpoint with the weights under the model's own
key (``fabric.save`` of a plain strategy), a Lightning checkpoint (``"state_dict"``) or ``torch.save`` of a state
dict."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightspeed.core.checkpoint.loading import is_export, read_exported
from lightspeed.core.errors import CheckpointError

__all__ = ["read_full_weights"]


def read_full_weights(
    path: str, model_key: str, load: Callable[[str], dict[str, Any]]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(weights, rest)``: the model's tensors in the file at ``path`` and the file's other entries (empty for an
    export or a plain state dict). ``load`` reads a ``torch.save`` file (the front end's checkpoint reader)."""
    if is_export(path):
        return read_exported(path), {}
    checkpoint = load(path)
    if isinstance(checkpoint.get(model_key), dict):
        return checkpoint.pop(model_key), checkpoint
    if isinstance(checkpoint.get("state_dict"), dict):
        return checkpoint.pop("state_dict"), checkpoint  # a Lightning checkpoint
    if checkpoint and all(isinstance(value, torch.Tensor) for value in checkpoint.values()):
        return checkpoint, {}  # torch.save(model.state_dict())
    raise CheckpointError(
        f"{path!r} holds no model weights: expected them under {model_key!r} (as `fabric.save` writes them), under "
        "'state_dict' (a Lightning checkpoint), or a plain state dict of tensors."
    )
