"""Shared pytest set-up: make `tests/` importable (for `_support`) and report why GPU tests are skipped."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


def _gpu_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU; none is visible on this machine (run `pytest -m gpu` on a GPU machine)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _gpu_skip_reason()
    if reason is None:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
