"""One torchrun launch of gather_cases.py per world size per test session, shared by the test modules."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import torch

from _support.launch import run_torchrun

SCRIPTS = Path(__file__).resolve().parent


@functools.cache
def launch(world: int) -> Path:
    """Run gather_cases.py on ``world`` gloo ranks (once) and return its output directory."""
    out = Path(tempfile.mkdtemp(prefix=f"lightspeed_gather_w{world}_"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    run_torchrun(SCRIPTS / "gather_cases.py", world, [out], env={"LIGHTSPEED_GATHER_TIMEOUT": "120"})
    return out


def case_results(world: int) -> list[dict]:
    """Per rank: what gather_cases.py saved."""
    out = launch(world)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def error_results() -> list[dict]:
    """Per rank of the 3-rank launch: bad-input case -> error message (or None)."""
    out = launch(3)
    return [json.loads((out / f"errors_rank{r}.json").read_text()) for r in range(3)]
