"""The options of an export, in one frozen object validated when it is built.

``lightspeed.export.export_checkpoint``, the ``ZeroExport`` callback and ``lightspeed export`` each turn what the
user gave into one :class:`ExportOptions`; the exporters below them take that object, so an option is declared,
defaulted and checked in one place, and a typo fails before any file is read or any training step runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lightspeed.core.checkpoint.hf_config import HFConfigFiles, resolve_hf_config
from lightspeed.core.checkpoint.plan import resolve_dtype
from lightspeed.core.checkpoint.safetensors_writer import parse_shard_size
from lightspeed.core.common.deprecation import renamed_keyword
from lightspeed.core.errors import ExportError

__all__ = ["PEFT_LAYOUTS", "ExportOptions", "exclude_frozen_choice"]

#: how a PEFT model is exported: its adapter in PEFT's layout, or its whole state_dict
PEFT_LAYOUTS = ("adapter", "merged", "full")


def exclude_frozen_choice(owner: str, exclude_frozen_parameters: bool, exclude_frozen: bool | None) -> bool:
    """``exclude_frozen_parameters`` of ``owner`` (``export_checkpoint``, ``ZeroExport``), or the value given under
    its deprecated name ``exclude_frozen`` (with a ``FutureWarning`` pointing at the user's call of ``owner``)."""
    return renamed_keyword(
        owner, "exclude_frozen", "exclude_frozen_parameters", exclude_frozen, exclude_frozen_parameters, False, depth=2
    )


@dataclass(frozen=True)
class ExportOptions:
    """What to export and how to write it (validated at construction: a bad dtype or shard size raises
    :class:`~lightspeed.core.errors.ExportError`).

    Attributes:
        dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (or the torch dtype) for floating tensors; integer buffers keep
            their dtype.
        max_shard_size: largest shard (``"2GB"``, ``"500MiB"``, bytes); None writes one file.
        tag: checkpoint tag to export (default: the one in ``latest``); DeepSpeed checkpoint directories only.
        exclude_frozen_parameters: leave out parameters with ``requires_grad=False``.
        strip_prefix: export only keys under this prefix, without it (e.g. ``"model."``).
        overwrite: replace a non-empty output directory.
        hf_config: write ``config.json`` beside the weights so ``from_pretrained`` loads the export: a Hugging Face
            config object (``to_json_file`` / ``save_pretrained``, e.g. ``model.config``), or the path of a
            ``config.json`` or of a directory holding one (its ``generation_config.json`` is copied too).
        peft: for a model holding a PEFT model (``peft.get_peft_model``): ``"adapter"`` writes PEFT's layout
            (``adapter_model.safetensors`` + ``adapter_config.json``, the trained adapter only, which
            ``PeftModel.from_pretrained`` loads; other adapters into subfolders named after them), ``"merged"`` the base
            model with the LoRA adapters folded into its weights, named as the base model and with its ``config.json``
            (from a running engine only: checkpoints leave the frozen base out), ``"full"`` the whole ``state_dict``
            as for any model. Other models are exported whole either way.
        hf_files: ``hf_config`` checked: what will be written beside the weights, None for nothing (derived).
        torch_dtype: ``dtype`` resolved to a torch dtype (derived).
        max_shard_bytes: ``max_shard_size`` in bytes, None for one file (derived).
    """

    dtype: str | torch.dtype = "fp32"
    max_shard_size: int | str | None = "5GB"
    tag: str | None = None
    exclude_frozen_parameters: bool = False
    strip_prefix: str | None = None
    overwrite: bool = False
    hf_config: Any = field(default=None, hash=False)
    peft: str = "adapter"
    hf_files: HFConfigFiles | None = field(init=False, repr=False, compare=False)
    torch_dtype: torch.dtype = field(init=False, repr=False, compare=False)
    max_shard_bytes: int | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # frozen: the derived fields are set once, here, through object.__setattr__
        if self.peft not in PEFT_LAYOUTS:
            raise ExportError(f"peft must be one of {', '.join(map(repr, PEFT_LAYOUTS))}, got {self.peft!r}")
        object.__setattr__(self, "torch_dtype", resolve_dtype(self.dtype))
        object.__setattr__(self, "max_shard_bytes", parse_shard_size(self.max_shard_size))
        object.__setattr__(self, "hf_files", resolve_hf_config(self.hf_config))
