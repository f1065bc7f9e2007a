"""Map the ``state_dict`` of a single-file Lightning checkpoint onto byte ranges of the file, loading no tensor.

What the Trainer writes without DeepSpeed (single device, DDP, FSDP with a full state dict, XLA, which moves every
tensor to the CPU before saving) is one ``torch.save`` archive of a dict: ``state_dict`` holds the
LightningModule's ``state_dict()``; next to it sit ``optimizer_states``, ``hyper_parameters``, ``loops``,
``callbacks`` and version fields. Only ``state_dict`` is exported. The pickle is read with
:mod:`.torch_zip` (tensors become :class:`FileRegion` references, unknown classes inert placeholders), so the
optimizer states are never loaded and no code from the file runs.

``torch.save`` writes a storage once however many tensors use it, so tied weights (``head.weight`` being
``embed.weight``) arrive as two regions with the same offset, shape and dtype: the first name in state_dict order
stores the data, later ones are recorded as aliases, as the ZeRO reader does. A plain checkpoint does not record
which parameters were frozen (``state_dict()`` saves detached tensors) nor which tensors are buffers: every tensor
is of kind ``"module"``.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightspeed.core.checkpoint.torch_zip import FileRegion, load_lazy
from lightspeed.core.checkpoint.zero_reader import TensorSource
from lightspeed.core.errors import CheckpointError

__all__ = ["LightningFileCheckpoint", "read_lightning_file"]

_INFO_KEYS = {"pytorch-lightning_version": "lightning_version", "epoch": "epoch", "global_step": "global_step"}
_DEEPSPEED_KEYS = ("module", "optimizer_state_dict", "ds_version", "ds_config")


@dataclass
class LightningFileCheckpoint:
    """The tensors of a single-file checkpoint's ``state_dict``, in its order, and where the file came from."""

    path: Path
    tensors: list[TensorSource]
    aliases: dict[str, str]  # tied name -> name of the tensor that holds the data
    skipped: list[str] = field(default_factory=list)  # non-tensor state_dict entries (extra state)
    info: dict[str, Any] = field(default_factory=dict)  # Lightning version, epoch, global step


def _not_lightning(path: Path, state: Any) -> CheckpointError:
    if not isinstance(state, dict):
        return CheckpointError(
            f"{path} is not a Lightning checkpoint: it holds a {type(state).__name__}, not a dict with a 'state_dict' "
            "entry; save it with trainer.save_checkpoint(path)"
        )
    keys = ", ".join(repr(k) for k in list(state)[:8]) or "none"
    if any(k in state for k in _DEEPSPEED_KEYS):
        return CheckpointError(
            f"{path} is one rank file of a DeepSpeed checkpoint (it has no 'state_dict' entry; keys: {keys}); pass "
            f"the checkpoint directory that holds the 'latest' file instead (e.g. {path.parent.parent})"
        )
    if state and all(isinstance(v, FileRegion) for v in state.values()):
        return CheckpointError(
            f"{path} is not a Lightning checkpoint: it has no 'state_dict' entry and looks like a bare state dict; "
            "wrap it first: torch.save({'state_dict': state_dict}, path)"
        )
    return CheckpointError(
        f"{path} is not a Lightning checkpoint: it has no 'state_dict' entry (top-level keys: {keys}); save it "
        "with trainer.save_checkpoint(path)"
    )


def read_lightning_file(checkpoint: str | os.PathLike) -> LightningFileCheckpoint:
    """Read the structure of the single-file checkpoint ``checkpoint`` (no tensor data) and find its tied weights."""
    path = Path(checkpoint)
    try:
        state = load_lazy(path)
    except (zipfile.BadZipFile, EOFError, OSError) as error:  # a damaged zip record that torch_zip reads directly
        raise CheckpointError(
            f"{path} is corrupt ({error}); it was damaged after saving or the save was interrupted - use an earlier "
            "checkpoint"
        ) from None
    state_dict = state.get("state_dict") if isinstance(state, dict) else None
    if not isinstance(state_dict, dict):
        raise _not_lightning(path, state)
    tensors: list[TensorSource] = []
    aliases: dict[str, str] = {}
    skipped: list[str] = []
    stored_at: dict[tuple, str] = {}
    for key, value in state_dict.items():
        name = str(key)
        if not isinstance(value, FileRegion):
            skipped.append(name)
            continue
        identity = (value.offset, value.numel, value.dtype, value.shape)
        if value.numel > 0 and identity in stored_at:
            aliases[name] = stored_at[identity]
            continue
        stored_at[identity] = name
        tensors.append(TensorSource(name, value.shape, value.dtype, "module", [value]))
    if not tensors:
        what = f"only non-tensor entries ({', '.join(skipped[:5])})" if skipped else "no entries"
        raise CheckpointError(f"{path}: the checkpoint's 'state_dict' holds {what}; there is nothing to export")
    info = {out: state[key] for key, out in _INFO_KEYS.items() if isinstance(state.get(key), (int, str))}
    return LightningFileCheckpoint(path, tensors, aliases, skipped, info)
