"""Every run ends cleanly: the process group lightspeed created is destroyed (with DeepSpeed's communication state)
before the interpreter tears down, so no rank dies with 'terminate called without an active exception' (-6)."""

from __future__ import annotations

import os

from _support.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_tiny_fit.py"
#: two fits per suite run (the abort was rare: every CI run adds two more); LIGHTSPEED_CLEAN_EXIT_RUNS=30 soaks
RUNS = int(os.environ.get("LIGHTSPEED_CLEAN_EXIT_RUNS", "2"))


def test_short_fits_in_a_row_all_exit_0() -> None:
    failures = []
    for attempt in range(RUNS):
        proc = run_torchrun(SCRIPT, 2, timeout=300, check=False, retry_native_abort=False)
        output = proc.stdout + proc.stderr
        clean = (
            proc.returncode == 0
            and "terminate called" not in output
            and all(f"rank {rank} finished step 2" in proc.stdout for rank in (0, 1))
        )
        if not clean:
            failures.append(f"run {attempt}: exit {proc.returncode}\n{output[-3000:]}")
    assert not failures, f"{len(failures)} of {RUNS} runs did not end cleanly:\n" + "\n\n".join(failures[:2])
