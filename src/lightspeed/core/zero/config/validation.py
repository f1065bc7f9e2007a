"""Rejecting DeepSpeed config keys DeepSpeed does not know, and values that are cheap to check up front.

DeepSpeed looks most plain-dict sections up key by key, so a misspelt key there is silently ignored and the run
goes on with a default the user never chose. Catching it here, with the closest valid key, saves a wasted run.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from typing import Any

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.config.activation import section_problems
from lightspeed.core.zero.config.choices import OFFLOAD_TARGETS, ZERO_STAGES
from lightspeed.core.zero.config.errors import problems_error
from lightspeed.core.zero.config.facts import front_end_in_prose
from lightspeed.core.zero.config.known_keys import Section, deepspeed_attr, top_level_section


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(path)


def _all_paths(section: Section, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for key in sorted(section.keys):
        yield prefix + (key,)
        child = section.children.get(key)
        if child is not None and len(prefix) < 4:
            yield from _all_paths(child, prefix + (key,))


def _suggestion(key: str, section: Section, path: tuple[str, ...]) -> str | None:
    """The closest valid dotted key: same section first, then the same name in another section."""
    known = sorted(section.keys)
    by_case = [k for k in known if k.lower() == key.lower()]
    if by_case:
        return _dotted(path + (by_case[0],))
    # A valid key put in the wrong section, e.g. "offload_optimizer" at the top level: an exact name elsewhere
    # beats a similar-looking one here.
    elsewhere = [p for p in _all_paths(top_level_section()) if p[-1] == key and p[:-1] != path]
    if elsewhere:
        return _dotted(min(elsewhere, key=len))
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return _dotted(path + (close[0],))
    return None


def _unknown_key_problem(key: str, section: Section, path: tuple[str, ...]) -> str:
    dotted = _dotted(path + (key,))
    suggestion = _suggestion(key, section, path)
    hint = f" (did you mean '{suggestion}'?)" if suggestion else ""
    if section.strict:
        effect = "DeepSpeed would stop on it with a pydantic validation error."
    else:
        effect = "DeepSpeed ignores unknown keys silently, so this would have had no effect."
    return f"Unknown DeepSpeed config key '{dotted}'{hint}. {effect} Fix or remove it."


def _walk(obj: dict, section: Section, path: tuple[str, ...], problems: list[str]) -> None:
    for key, value in obj.items():
        dotted = _dotted(path + (key,))
        if not isinstance(key, str):
            problems.append(
                f"DeepSpeed config key {key!r} under '{_dotted(path) or 'the top level'}' is not a "
                "string. Use string keys, as in JSON."
            )
            continue
        if key in section.removed:
            problems.append(
                f"DeepSpeed config key '{dotted}' is no longer supported by DeepSpeed: "
                f"{section.removed[key].strip()} Remove it."
            )
            continue
        if key not in section.keys:
            problems.append(_unknown_key_problem(key, section, path))
            continue
        child = section.children.get(key)
        if child is None or value is None:
            continue
        if isinstance(value, dict):
            _walk(value, child, path + (key,), problems)
        elif not (path == () and key == "zero_optimization" and isinstance(value, bool)):
            # (a bare boolean zero_optimization is DeepSpeed's deprecated stage 0/1 switch, still accepted)
            problems.append(
                f"DeepSpeed config key '{dotted}' must be an object ({{...}} with its own keys), got "
                f'{value!r}. Write it as a JSON object, e.g. "{key}": {_example_object(child)}.'
            )


def _example_object(section: Section) -> str:
    if "enabled" in section.keys:
        return '{"enabled": true}'
    if "device" in section.keys:
        return '{"device": "cpu"}'
    if "type" in section.keys:
        return '{"type": "...", "params": {...}}'
    return "{...}"


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _value_problems(config: dict, front_end: str) -> list[str]:
    problems: list[str] = []
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = config.get(key, "auto")
        if value != "auto" and not (_is_whole(value) and value >= 1):
            problems.append(
                f'{key} must be a whole number >= 1 or "auto", got {value!r}. Write e.g. "{key}": 8, '
                f'or "auto" to take it from {front_end_in_prose(front_end)}.'
            )
    clip = config.get("gradient_clipping", "auto")
    if clip != "auto" and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0):
        problems.append(f'gradient_clipping must be a number >= 0 (0 means no clipping) or "auto", got {clip!r}.')
    if isinstance(config.get("bf16"), dict) and "bfloat16" in config:
        problems.append(
            "The DeepSpeed config has both 'bf16' and its old name 'bfloat16'; DeepSpeed reads only "
            "'bf16' then. Remove 'bfloat16'."
        )
    zero = config.get("zero_optimization")
    stage: Any = 0
    if isinstance(zero, dict):
        stage = zero.get("stage", 0)
        if isinstance(stage, bool) or stage not in ZERO_STAGES:
            problems.append(
                f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r} (zero_optimization.stage). "
                "Set it to one of those numbers."
            )
            stage = None
        for name in ("offload_optimizer", "offload_param"):
            offload = zero.get(name)
            if not isinstance(offload, dict):
                continue
            device = offload.get("device", "none")
            if device not in OFFLOAD_TARGETS:
                problems.append(
                    f"zero_optimization.{name}.device must be 'none', 'cpu' or 'nvme', got {device!r}. "
                    "Set it to one of those."
                )
                continue
            if device == "nvme" and not offload.get("nvme_path"):
                problems.append(
                    f"zero_optimization.{name}.device is 'nvme' but zero_optimization.{name}.nvme_path "
                    "is not set. Set nvme_path to a directory on the NVMe drive, e.g. '/local_nvme'."
                )
            if device != "none" and name == "offload_param" and stage is not None and stage != 3:
                problems.append(
                    f"zero_optimization.offload_param only works with ZeRO stage 3, but the stage is "
                    f"{stage}. Use stage 3, or remove offload_param."
                )
            if device != "none" and name == "offload_optimizer" and stage == 0:
                problems.append(
                    "zero_optimization.offload_optimizer needs ZeRO stage 1, 2 or 3, but the stage is "
                    "0. Raise the stage, or remove offload_optimizer."
                )
    scheduler = config.get("scheduler")
    if isinstance(scheduler, dict) and isinstance(scheduler.get("type"), str) and scheduler["type"] != "auto":
        valid = deepspeed_attr("deepspeed.runtime.lr_schedules", "VALID_LR_SCHEDULES")
        if valid and scheduler["type"] not in valid:
            close = difflib.get_close_matches(scheduler["type"], list(valid), n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            problems.append(
                f"Unknown DeepSpeed scheduler type '{scheduler['type']}'{hint} in scheduler.type. "
                f"DeepSpeed has: {', '.join(valid)}. Use one of them, or configure the scheduler in "
                "the LightningModule instead."
            )
    problems += section_problems(config)
    return problems


def validate_keys(config: dict, front_end: str = "Trainer") -> None:
    """Raise one :class:`DeepSpeedConfigError` listing every unknown key (with the closest valid one) and every
    cheaply detectable bad value; return ``None`` when the config is clean."""
    if not isinstance(config, dict):
        raise DeepSpeedConfigError(
            f"The DeepSpeed config must be a dict, got a {type(config).__name__}. Load files "
            "with load_user_config first."
        )
    problems: list[str] = []
    _walk(config, top_level_section(), (), problems)
    problems += _value_problems(config, front_end)
    if problems:
        raise problems_error(problems, "in the DeepSpeed config")
