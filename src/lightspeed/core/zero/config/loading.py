"""Reading the user's DeepSpeed config (dict or JSON file) and printing it for logs."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from lightspeed.core.errors import DeepSpeedConfigError


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.load keeps the last of two equal keys without a word; DeepSpeed's own loader refuses them, so do we.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


#: the variable Lightning's DeepSpeed strategies read a config path from when none is given
CONFIG_PATH_ENV = "PL_DEEPSPEED_CONFIG_PATH"


def config_or_environment(config: dict | str | os.PathLike | None) -> dict | str | os.PathLike | None:
    """``config``, or when it is None the JSON file ``$PL_DEEPSPEED_CONFIG_PATH`` names (as Lightning's DeepSpeed
    strategies read it); the file then goes through the same checks as ``config=``."""
    if config is not None or not os.environ.get(CONFIG_PATH_ENV):
        return config
    path = os.environ[CONFIG_PATH_ENV]
    if not os.path.isfile(path):
        raise DeepSpeedConfigError(
            f"{CONFIG_PATH_ENV}={path!r} names no file. Point it at the DeepSpeed config's JSON file, pass the config "
            f"with `config=`, or unset {CONFIG_PATH_ENV}."
        )
    return path


def load_user_config(config: dict | str | os.PathLike | None) -> dict:
    """Return the user's DeepSpeed config as a fresh dict that the caller may modify.

    ``None`` gives ``{}``, a dict is deep-copied (the caller's dict is never mutated), a ``str`` or path is read
    as a JSON file. Every failure raises :class:`DeepSpeedConfigError` naming the path and the fix.
    """
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if not isinstance(config, (str, os.PathLike)):
        raise DeepSpeedConfigError(
            f"The DeepSpeed config must be a dict, a path to a JSON file, or None; got a {type(config).__name__}. "
            "Pass the config as a dict or as the path of its JSON file."
        )
    path = os.fspath(config)
    if not os.path.exists(path):
        raise DeepSpeedConfigError(
            f"DeepSpeed config file '{path}' does not exist. Pass the path of an existing JSON file, or pass the "
            "config as a dict."
        )
    if os.path.isdir(path):
        raise DeepSpeedConfigError(
            f"DeepSpeed config path '{path}' is a directory, not a file. Pass the path of the JSON file itself "
            "(for example 'ds_config.json' inside that directory)."
        )
    try:
        with open(path, encoding="utf-8") as handle:
            loaded = json.load(handle, object_pairs_hook=_reject_duplicate_keys)
    except json.JSONDecodeError as err:
        raise DeepSpeedConfigError(
            f"DeepSpeed config file '{path}' is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}. "
            "Fix the JSON syntax there (JSON allows no comments and no trailing commas)."
        ) from err
    except _DuplicateKey as err:
        raise DeepSpeedConfigError(
            f"DeepSpeed config file '{path}' sets the key '{err.key}' twice in the same object. Keep only one of "
            "them (JSON readers silently keep the last one)."
        ) from None
    except UnicodeDecodeError as err:
        raise DeepSpeedConfigError(
            f"DeepSpeed config file '{path}' is not UTF-8 text ({err.reason}). Save it as a UTF-8 JSON file."
        ) from err
    except OSError as err:
        raise DeepSpeedConfigError(
            f"DeepSpeed config file '{path}' cannot be read: {err.strerror or err}. Check its permissions."
        ) from err
    if not isinstance(loaded, dict):
        raise DeepSpeedConfigError(
            f"DeepSpeed config file '{path}' must hold a JSON object ({{...}}) at the top level, but it holds a "
            f"JSON {_json_kind(loaded)}. Wrap the settings in {{ }} with one key per setting."
        )
    return loaded


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"


def describe_config(config: dict) -> str:
    """Pretty, key-sorted JSON of a config, for logging what DeepSpeed will actually receive."""
    return json.dumps(config, indent=2, sort_keys=True, default=str)


def summarize_config(config: dict) -> str:
    """One line with what a person checks first in a resolved config: the ZeRO stage, where optimizer states and
    parameters live, the micro-batch and accumulation, the precision and clipping."""
    zero = config.get("zero_optimization") or {}
    parts = [f"ZeRO-{zero.get('stage', 0)}"]
    for section, what in (("offload_optimizer", "optimizer states"), ("offload_param", "parameters")):
        device = (zero.get(section) or {}).get("device", "none")
        if device != "none":
            parts.append(f"{what} on {device}")
    parts.append(
        f"micro-batch {config.get('train_micro_batch_size_per_gpu', '?')} x "
        f"{config.get('gradient_accumulation_steps', 1)} accumulated"
    )
    enabled = [name for name in ("bf16", "fp16") if (config.get(name) or {}).get("enabled") is True]
    parts.append(enabled[0] if enabled else "fp32")
    clipping = config.get("gradient_clipping") or 0
    parts.append(f"clipping at {clipping:g}" if clipping else "no clipping")
    return ", ".join(parts)
