"""Deep merge of two DeepSpeed configs (a preset and the user's overrides)."""

from __future__ import annotations

import copy


def merge_configs(base: dict, override: dict) -> dict:
    """A new dict with ``override`` merged into ``base``: nested dicts merge key by key, anything else in
    ``override`` (including lists and ``None``) replaces the value in ``base``. Neither input is modified."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_configs(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged
