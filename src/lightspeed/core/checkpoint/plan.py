"""Decide what an export contains: which keys (prefix, frozen parameters), under which names, in which dtype, and
how tied weights are recorded. Shared by the checkpoint exporter and the live-engine exporter."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from lightspeed._version import __version__
from lightspeed.core.errors import ExportError

__all__ = [
    "DTYPES",
    "EXPORT_METADATA_KEY",
    "TIED_METADATA_KEY",
    "WRAPPER_PREFIX",
    "OutputTensor",
    "output_dtype",
    "resolve_dtype",
    "safetensors_metadata",
    "select_keys",
    "wrapper_unwrapper",
]

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}
WRAPPER_PREFIX = "_forward_module."  # Lightning < 2.1 wrapped the LightningModule under this attribute
TIED_METADATA_KEY = "lightspeed_tied"  # JSON {tied name: name of the stored tensor}
EXPORT_METADATA_KEY = "lightspeed_export"  # JSON with dtype, source and version


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"fp32"``/``"bf16"``/``"fp16"`` (or the torch dtype) -> torch dtype of the exported floating tensors."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str):
        name = dtype.lower().removeprefix("torch.")
        if name in DTYPES:
            return DTYPES[name]
    raise ExportError(f"unsupported export dtype {dtype!r}; choose fp32, bf16 or fp16")


def wrapper_unwrapper(names: Iterable[str]) -> Callable[[str], str]:
    """A renaming that drops Lightning's old ``_forward_module.`` wrapper prefix when every name in ``names`` carries
    it (the module was saved wrapped), else the identity: exports use the LightningModule's own key names."""
    names = list(names)
    if names and all(name.startswith(WRAPPER_PREFIX) for name in names):
        return lambda name: name.removeprefix(WRAPPER_PREFIX)
    return lambda name: name


def output_dtype(stored: torch.dtype, requested: torch.dtype) -> torch.dtype:
    """Floating tensors are converted to the requested dtype; integer and bool buffers keep theirs."""
    return requested if stored.is_floating_point else stored


@dataclass
class OutputTensor:
    """One tensor to write: its exported name, shape, written dtype and a function that produces its data."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]
    kind: str = "param"

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()


def select_keys(
    keys: list[str],
    kinds: dict[str, str],
    aliases: dict[str, str],
    *,
    exclude_frozen_parameters: bool = False,
    strip_prefix: str | None = None,
    rename: Mapping[str, str] | None = None,
) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """Choose the exported keys.

    ``rename`` (an adapter's layout: export name -> key) exports exactly those keys under those names instead; a
    key missing from ``keys`` is an :class:`ExportError`.

    ``keys`` is the module's state_dict order, ``kinds`` maps every stored name to "param"/"frozen"/"buffer"/...,
    ``aliases`` maps a tied name to the stored name. Returns ``[(export name, stored name)]`` in order and the
    exported aliases ``{export alias: export name of the stored tensor}``. With ``strip_prefix`` only keys under the
    prefix are exported, without it (the wrapped sub-model); a tied key whose owner falls outside is written itself.
    """

    if rename is not None:
        missing = sorted(key for key in rename.values() if key not in kinds and key not in aliases)
        if missing:
            raise ExportError(f"the adapter's tensors are not in the model: {', '.join(missing[:5])}")
        return [(name, aliases.get(key, key)) for name, key in rename.items()], {}

    def under_prefix(name: str) -> bool:
        return not strip_prefix or (name.startswith(strip_prefix) and len(name) > len(strip_prefix))

    def exported_name(name: str) -> str:  # of a wanted name, which is under the prefix
        return name[len(strip_prefix) :] if strip_prefix else name

    def wanted(name: str) -> bool:
        owner = aliases.get(name, name)
        if exclude_frozen_parameters and kinds.get(owner) == "frozen":
            return False
        return under_prefix(name)

    stored = [(exported_name(n), n) for n in keys if n not in aliases and wanted(n)]
    exported_aliases: dict[str, str] = {}
    for alias in keys:
        if alias not in aliases or not wanted(alias):
            continue
        owner = aliases[alias]
        if wanted(owner):
            exported_aliases[exported_name(alias)] = exported_name(owner)
        else:
            stored.append((exported_name(alias), owner))
    if strip_prefix and not stored:
        examples = ", ".join(list(keys)[:5])
        raise ExportError(f"no key starts with the prefix {strip_prefix!r} to strip; the keys begin like: {examples}")
    if not stored:
        raise ExportError("nothing to export: every tensor was excluded")
    return stored, exported_aliases


def safetensors_metadata(aliases: dict[str, str], dtype: torch.dtype, source: dict) -> dict[str, str]:
    """The ``__metadata__`` of every shard: HF's ``format`` plus the tied keys and where the export came from."""
    info = {"dtype": str(dtype).removeprefix("torch."), "lightspeed_version": __version__, **source}
    return {
        "format": "pt",
        TIED_METADATA_KEY: json.dumps(aliases, sort_keys=True),
        EXPORT_METADATA_KEY: json.dumps(info, sort_keys=True, default=str),
    }
