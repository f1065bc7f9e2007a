"""The Hugging Face files written beside the weights, so that ``from_pretrained(export_dir)`` loads an export.

``config.json`` (and ``generation_config.json``) come from a config object (anything with ``to_json_file`` or
``save_pretrained``, e.g. ``transformers.PretrainedConfig``), from the model being exported (its ``.config`` and
``.generation_config``), or are copied from a directory or file. Duck typing only: transformers is never imported.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightspeed.core.errors import ExportError

__all__ = ["CONFIG_FILE", "GENERATION_CONFIG_FILE", "HFConfigFiles", "find_hf_config", "resolve_hf_config"]

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


def _is_config_object(value: Any) -> bool:
    return callable(getattr(value, "to_json_file", None)) or callable(getattr(value, "save_pretrained", None))


@dataclass(frozen=True)
class HFConfigFiles:
    """What to write beside the weights: ``config`` (an object or a JSON file to copy) and, optionally,
    ``generation_config`` (likewise)."""

    config: Any
    generation_config: Any = None

    def write(self, directory: Path) -> list[str]:
        """Write ``config.json`` (and ``generation_config.json``) into ``directory``; returns the names written."""
        written = [_write_one(self.config, directory, CONFIG_FILE, "hf_config")]
        if self.generation_config is not None:
            written.append(_write_one(self.generation_config, directory, GENERATION_CONFIG_FILE, "generation config"))
        return written


def _write_one(source: Any, directory: Path, file_name: str, what: str) -> str:
    target = directory / file_name
    if isinstance(source, Path):
        shutil.copyfile(source, target)
    elif callable(getattr(source, "to_json_file", None)):
        source.to_json_file(target)
    else:
        # save_pretrained(dir) chooses its own file name (config.json for a model config, generation_config.json
        # for a generation config): save into an empty directory and take the one JSON file it wrote
        with tempfile.TemporaryDirectory(dir=directory, prefix=".save_pretrained-") as scratch:
            source.save_pretrained(scratch)
            produced = sorted(p for p in Path(scratch).iterdir() if p.suffix == ".json")
            if len(produced) != 1:
                raise ExportError(
                    f"the {what}'s save_pretrained() wrote {[p.name for p in produced]}, not one JSON file; pass an "
                    f"object with to_json_file() or the path of the {file_name} to copy"
                )
            shutil.move(str(produced[0]), target)
    if not target.is_file():
        raise ExportError(f"the {what} did not write {file_name}")
    return file_name


def resolve_hf_config(value: Any) -> HFConfigFiles | None:
    """Check ``value`` (None, a config object, an :class:`HFConfigFiles`, or the path of a directory holding
    ``config.json`` or of a JSON file) and say what it will write; raises :class:`ExportError` when it cannot be
    used. A directory also gives its ``generation_config.json`` when it has one."""
    if value is None or isinstance(value, HFConfigFiles):
        return value
    if isinstance(value, (str, os.PathLike)):
        path = Path(value)
        if path.is_dir():
            config = path / CONFIG_FILE
            if not config.is_file():
                raise ExportError(
                    f"hf_config directory {path} has no {CONFIG_FILE}; pass a directory written by "
                    "save_pretrained() or the path of the config JSON file"
                )
            generation = path / GENERATION_CONFIG_FILE
            return HFConfigFiles(config, generation if generation.is_file() else None)
        if path.is_file():
            return HFConfigFiles(path)
        raise ExportError(f"hf_config {path} does not exist; pass a config.json file or the directory holding it")
    if _is_config_object(value):
        return HFConfigFiles(value)
    raise ExportError(
        f"hf_config must be a Hugging Face config (an object with to_json_file() or save_pretrained(), e.g. "
        f"model.config) or the path of a config.json file or its directory; got {type(value).__name__}"
    )


def find_hf_config(module: Any, strip_prefix: str | None) -> HFConfigFiles | None:
    """The Hugging Face config of the module an export writes: ``module`` itself, or its submodule at
    ``strip_prefix`` (``"model."`` -> ``module.model``). None when that module has no ``.config`` with
    ``to_json_file`` / ``save_pretrained``; its ``.generation_config`` is included when it has one."""
    target = module
    path = (strip_prefix or "").strip(".")
    if path:
        get_submodule = getattr(module, "get_submodule", None)
        if get_submodule is None:
            return None
        try:
            target = get_submodule(path)
        except AttributeError:
            return None
    config = getattr(target, "config", None)
    if not _is_config_object(config):
        return None
    generation = getattr(target, "generation_config", None)
    return HFConfigFiles(config, generation if _is_config_object(generation) else None)
