"""Run a process tree under an OS memory cap: a cgroup v1 memory group (``/sys/fs/cgroup/memory``), which the kernel
enforces on every process started inside it, children included (torchrun and its ranks). Nothing here is simulated:
a process tree that needs more than the cap is killed by the kernel's OOM killer, as on a real machine."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")


def memory_cap_unavailable() -> str | None:
    """Why no memory cap can be made here (for a test's skip reason), None when one can."""
    if not CGROUP_MEMORY.is_dir():
        return f"no cgroup v1 memory controller at {CGROUP_MEMORY}"
    if os.geteuid() != 0:
        return "creating a memory cgroup needs root"
    probe = CGROUP_MEMORY / f"lightspeed-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as error:
        return f"cannot create a memory cgroup under {CGROUP_MEMORY}: {error}"
    return None


@dataclass(frozen=True)
class MemoryGroup:
    """One memory cgroup: its folder and the cap it enforces."""

    path: Path
    limit_bytes: int

    def join(self) -> None:
        """Move the calling process into the group (a ``preexec_fn``: the child is in the group before it execs)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    @property
    def peak_bytes(self) -> int:
        """The group's peak charge (anonymous memory and page cache of every process in it)."""
        return int(self._read("memory.max_usage_in_bytes"))

    @property
    def oom_kills(self) -> int:
        """How many processes the kernel killed for exceeding the cap (0 on kernels that do not count them)."""
        for line in self._read("memory.oom_control").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def run(
        self, cmd: Sequence[str], *, env: dict[str, str], cwd: Path, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` inside the group to its end (its output captured)."""
        return subprocess.run(
            list(cmd), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, preexec_fn=self.join
        )


@contextmanager
def memory_cap(limit_bytes: int) -> Iterator[MemoryGroup]:
    """A fresh memory cgroup capped at ``limit_bytes`` (swap included, where the kernel accounts it); on exit every
    process still in it is killed and the group removed."""
    path = CGROUP_MEMORY / f"lightspeed-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        swap_limit = path / "memory.memsw.limit_in_bytes"
        if swap_limit.exists():
            swap_limit.write_text(str(limit_bytes))
        yield MemoryGroup(path, limit_bytes)
    finally:
        for pid in (path / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        _remove(path)


def _remove(path: Path) -> None:
    """Remove an emptied group (the kernel needs a moment after the last process has died)."""
    import time

    for _ in range(50):
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.1)
    path.rmdir()
