"""The verdict of ``lightspeed test``: comparing the ranks' results, and the fix for failures with a known cause."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from lightspeed.core.zero.config import NVME_PATH_ENV


@dataclass(frozen=True)
class Check:
    """One line of the verdict."""

    name: str
    passed: bool
    detail: str = ""

    def line(self) -> str:
        return f"  {'PASS' if self.passed else 'FAIL'}  {self.name}{': ' + self.detail if self.detail else ''}"


KNOWN_CAUSES: tuple[tuple[str, str], ...] = (
    (
        r"[Nn]inja is required|ninja: not found|No module named 'ninja'",
        "DeepSpeed compiles its CPU Adam on first use and needs ninja: `pip install ninja`.",
    ),
    (
        r"(c\+\+|g\+\+|gcc|x86_64-linux-gnu-g\+\+)['\"]?:? (command )?not found|unable to execute '(c\+\+|g\+\+|gcc)'"
        r"|No such file or directory: '(c\+\+|g\+\+)'|error: command '(c\+\+|g\+\+|gcc)' failed",
        "DeepSpeed's CPU Adam (optimizer offload) needs a C++ compiler: `apt-get install build-essential` (Debian/"
        "Ubuntu), or install a DeepSpeed built with DS_BUILD_CPU_ADAM=1.",
    ),
    (
        r"libaio|aio\.h|async_io op is not",
        "NVMe offload needs DeepSpeed's async_io op: `apt-get install libaio-dev`, then "
        "run again (DeepSpeed compiles it on first use).",
    ),
    (rf"NVMe offload needs a directory|{NVME_PATH_ENV}", "pass --nvme-path DIR (a directory on an NVMe drive)."),
    (
        r"CUDA out of memory|OutOfMemoryError",
        "a GPU ran out of memory: close other jobs on it or use fewer/other GPUs.",
    ),
    (r"Address already in use|EADDRINUSE", "the rendezvous port was taken: run again."),
)


def diagnose(log: str) -> str | None:
    """The fix for a known failure found in a worker's log, or None."""
    for pattern, fix in KNOWN_CAUSES:
        if re.search(pattern, log):
            return fix
    return None


def last_error_line(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", line):
            return line
    return lines[-1] if lines else "no output"


def compare_ranks(results: list[dict[str, Any]], world_size: int, steps: int) -> list[Check]:
    """The checks on the workers' results: all ran, trained, changed the weights and agree with each other."""
    checks: list[Check] = []
    ranks = sorted(r["rank"] for r in results)
    started = ranks == list(range(world_size)) and all(r["world_size"] == world_size for r in results)
    checks.append(Check("processes started", started, f"ranks {ranks} of {world_size}"))
    if not results:
        return checks
    ran = all(r["steps"] == steps and r["losses"] and all(math.isfinite(x) for x in r["losses"]) for r in results)
    detail = ", ".join(
        f"rank {r['rank']}: {r['steps']} steps, last loss {r['losses'][-1] if r['losses'] else 'none'}" for r in results
    )
    checks.append(Check(f"trained {steps} steps with finite losses", ran, detail))
    changed = all(r["initial_weights"] != r["final_weights"] for r in results)
    checks.append(Check("optimizer changed the weights", changed))

    def agree(name: str, key: str) -> None:
        values = {r["rank"]: r[key] for r in results}
        same = len({json.dumps(v, sort_keys=True) for v in values.values()}) == 1
        if same:
            value = next(iter(values.values()))
            shown = value[:12] if isinstance(value, str) else ""
            checks.append(Check(name, True, f"sha256 {shown}" if shown else ""))
        else:
            differing = sorted(rank for rank, v in values.items() if v != values[min(values)])
            checks.append(Check(name, False, f"rank(s) {differing} differ from rank {min(values)}"))

    agree("RNG agrees across ranks after seeding (torch, numpy, python)", "rng_after_seed")
    agree("initial weights agree across ranks", "initial_weights")
    agree("RNG agrees across ranks after training", "rng_after_training")
    agree("final weights agree across ranks", "final_weights")
    return checks
