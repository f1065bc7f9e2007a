"""Export DeepSpeed ZeRO checkpoints and single-file Lightning checkpoints to consolidated safetensors, and load
exports back.

```python
from lightspeed.export import export_checkpoint, load_exported

export_checkpoint("checkpoints/last.ckpt", "export/", dtype="bf16", max_shard_size="2GB")  # ZeRO directory
export_checkpoint("checkpoints/epoch=3.ckpt", "export/")  # a file: single device, DDP or XLA
export_checkpoint(["node0/last.ckpt", "node1/last.ckpt"], "export/")  # node-local: every node's directory
load_exported(fresh_model, "export/")   # strict: every key must match
```

The export is written one tensor at a time from the rank files or the checkpoint file (memory: about one tensor,
not the model; a file's optimizer states are never loaded), in
the Hugging Face layout (``model.safetensors``, or shards plus ``model.safetensors.index.json``), with the
LightningModule's ``state_dict()`` names. Tied weights are stored once and restored by :func:`load_exported`.
``strip_prefix="model."`` exports a wrapped Hugging Face model; with ``hf_config=`` (its config object, or the
directory/``config.json`` written by ``save_pretrained``) ``config.json`` is written beside the weights, so that
``from_pretrained(out)`` loads the export directly. :func:`export_checkpoint` returns an :class:`ExportResult` (the
files written, the tensor count and bytes, the tied names), :func:`load_exported` a :class:`LoadResult` (missing and
unexpected keys, like ``load_state_dict``).

The errors are :class:`lightspeed.errors.CheckpointError` (the checkpoint) and :class:`lightspeed.errors.ExportError`
(the output); ``lightspeed.export.CheckpointError`` and ``lightspeed.export.ExportError`` still work, deprecated (a
``FutureWarning``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightspeed.core import errors as _errors
from lightspeed.core.checkpoint.exporter import ExportResult, export_checkpoint_path
from lightspeed.core.checkpoint.loading import LoadResult
from lightspeed.core.checkpoint.loading import load_exported as _load_exported
from lightspeed.core.checkpoint.options import ExportOptions, exclude_frozen_choice
from lightspeed.core.checkpoint.safetensors_writer import Progress
from lightspeed.core.common.deprecation import moved_attribute

__all__ = ["ExportResult", "LoadResult", "export_checkpoint", "load_exported"]

#: names once public here, still reachable with a FutureWarning: old name -> (new spelling, object)
_MOVED = {
    "CheckpointError": ("lightspeed.errors.CheckpointError", _errors.CheckpointError),
    "ExportError": ("lightspeed.errors.ExportError", _errors.ExportError),
}

if not TYPE_CHECKING:  # type checkers report the old names as missing; at run time they still work

    def __getattr__(name: str) -> object:
        return moved_attribute(__name__, name, _MOVED)


def export_checkpoint(
    ckpt: str | os.PathLike | Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "fp32",
    max_shard_size: int | str | None = "5GB",
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    strip_prefix: str | None = None,
    overwrite: bool = False,
    hf_config: Any = None,
    progress: Progress | None = None,
    exclude_frozen: bool | None = None,
    peft: str = "adapter",
) -> ExportResult:
    """Export the checkpoint ``ckpt`` to safetensors in ``out``: a DeepSpeed checkpoint directory (Lightning's
    ``<name>.ckpt/`` or DeepSpeed's save dir), or a single-file Lightning checkpoint (its ``state_dict``).

    Args:
        ckpt: the checkpoint directory (holding ``latest`` and a tag folder), a tag folder, or a ``.ckpt`` file
            written by ``trainer.save_checkpoint`` without DeepSpeed (single device, DDP, XLA); or the list of every
            node's directory of one node-local checkpoint (``ZeroStrategy(node_local_storage=True)``), e.g.
            ``["node0/last.ckpt", "node1/last.ckpt"]``: the export equals that of a shared-filesystem checkpoint.
        out: output directory; must be missing or empty unless ``overwrite``. Written atomically.
        dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"`` for floating tensors (integer buffers keep their dtype).
            ZeRO: trainable weights come from the fp32 master copy, frozen ones from the training-dtype copy;
            a file: the weights as saved.
        max_shard_size: largest shard (``"2GB"``, ``"500MiB"``, bytes); None writes one file.
        tag: checkpoint tag to export (default: the one in ``latest``); not for a file.
        exclude_frozen_parameters: leave out parameters with ``requires_grad=False``, as the ZeRO strategies'
            ``exclude_frozen_parameters`` leaves them out of checkpoints. Refused for a file and for ZeRO stage 0,
            which do not record it.
        strip_prefix: export only keys under this prefix, without it (e.g. ``"model."``).
        overwrite: replace a non-empty ``out``.
        hf_config: also write the Hugging Face ``config.json``: a config object (``model.config``: anything with
            ``to_json_file`` or ``save_pretrained``), or the path of a ``config.json`` or of the directory holding
            it (its ``generation_config.json`` is copied too). Written inside the atomic output with the weights.
        progress: called with (bytes written, total bytes) after each tensor.
        exclude_frozen: deprecated name of ``exclude_frozen_parameters`` (works, with a ``FutureWarning``).
        peft: a checkpoint of a model holding a PEFT model: ``"adapter"`` writes PEFT's layout
            (``adapter_model.safetensors`` + ``adapter_config.json``, which ``PeftModel.from_pretrained`` loads),
            ``"full"`` the whole ``state_dict``.
    """
    options = ExportOptions(
        dtype=dtype,
        max_shard_size=max_shard_size,
        tag=tag,
        exclude_frozen_parameters=exclude_frozen_choice("export_checkpoint", exclude_frozen_parameters, exclude_frozen),
        strip_prefix=strip_prefix,
        overwrite=overwrite,
        hf_config=hf_config,
        peft=peft,
    )
    return export_checkpoint_path(ckpt, out, options, progress)


def load_exported(module: nn.Module, path: str | os.PathLike, strict: bool = True) -> LoadResult:
    """Load the export at ``path`` (directory, ``.safetensors`` file or index) into ``module``.

    With ``strict`` (default) the module's keys and the export's must be the same; a mismatch raises
    :class:`~lightspeed.errors.ExportError` listing the missing and unexpected keys and leaves the module unchanged.

    Args:
        module: the plain module to load into (the model the export was written from, built without DeepSpeed).
        path: an export directory, a ``.safetensors`` file or a ``model.safetensors.index.json``.
        strict: refuse missing and unexpected keys (``False``: load what matches and report the rest in the result).
    """
    return _load_exported(module, path, strict=strict)
