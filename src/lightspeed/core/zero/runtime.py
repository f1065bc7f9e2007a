"""Pointing DeepSpeed at the right device family without the user setting ``DS_ACCELERATOR``.

DeepSpeed picks its accelerator once (CUDA when it sees one, otherwise CPU) and caches it. Lightning users choose
the device with ``Trainer(accelerator=...)``; these helpers make DeepSpeed agree with that choice in the launching
process (through the environment, inherited by every rank) and inside each rank (through DeepSpeed's API, in case
DeepSpeed was imported before the choice was known).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightspeed.core.errors import DeepSpeedConfigError

DEVICE_KINDS = ("cpu", "cuda")
TORCH_EXTENSIONS_ENV = "TORCH_EXTENSIONS_DIR"


def venv_torch_extensions_dir(prefix: str | os.PathLike[str] | None = None) -> Path:
    """Where ``scripts/setup.sh`` prebuilds DeepSpeed's CPU ops: ``<prefix>/torch_extensions`` (default: this
    interpreter's ``sys.prefix``, the virtual environment when one is in use)."""
    return Path(sys.prefix if prefix is None else prefix) / "torch_extensions"


def use_prebuilt_deepspeed_ops(prefix: str | os.PathLike[str] | None = None) -> Path | None:
    """Make DeepSpeed's JIT-compiled ops come from the environment's prebuilt cache; returns the cache in use.

    * ``TORCH_EXTENSIONS_DIR`` unset and ``<prefix>/torch_extensions`` exists: the variable is set to it, so a
      process that did not source ``scripts/env.sh`` loads the ops ``setup.sh`` compiled instead of compiling them
      again into ``~/.cache/torch_extensions``. A value the user set is never changed.
    * When the cache in use is the environment's own, torch must run the environment's ``ninja`` (the one that built
      it): torch runs ``ninja`` from ``PATH``, and ninja 1.13 hashes command lines differently from ninja <= 1.12
      (both write the same ``.ninja_log``), so a system ``/usr/bin/ninja`` found first on the ``PATH`` of an
      unactivated virtual environment sees every command "changed" and rebuilds every op, and the next run with the
      environment's ninja rebuilds them back. ``<prefix>/bin`` is put first on ``PATH`` (what activating the
      environment does) when it holds a ninja that is not the one ``PATH`` finds.

    Returns the extension cache directory when ``TORCH_EXTENSIONS_DIR`` is set (by the user or here), else None
    (torch's default under ``~/.cache``). Idempotent; touches nothing on disk.
    """
    root = Path(sys.prefix if prefix is None else prefix)
    prebuilt = venv_torch_extensions_dir(root)
    current = os.environ.get(TORCH_EXTENSIONS_ENV)
    if current is None:
        if not prebuilt.is_dir():
            return None
        os.environ[TORCH_EXTENSIONS_ENV] = current = str(prebuilt)
    if os.path.realpath(current) == os.path.realpath(prebuilt):
        _put_first_on_path(root / "bin", "ninja")
    return Path(current)


def _put_first_on_path(bin_dir: Path, program: str) -> None:
    """Prepend ``bin_dir`` to ``PATH`` when it holds ``program`` and ``PATH`` resolves ``program`` elsewhere."""
    candidate = bin_dir / program
    if not (candidate.is_file() and os.access(candidate, os.X_OK)):
        return
    found = shutil.which(program)
    if found is not None and os.path.realpath(found) == os.path.realpath(candidate):
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(bin_dir), path]) if path else str(bin_dir)


#: a build lock this old with no process building beside it was left by a build killed half-way
STALE_LOCK_AGE_S = 300.0
#: younger locks belong to a load or build in progress (torch locks even to check an up-to-date op): no message
_QUIET_S = 10.0


def _processes_building_in(build_dir: Path) -> list[int]:
    """Other processes whose working directory is ``build_dir`` (torch runs ninja and the compilers there)."""
    target = os.path.realpath(build_dir)
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        if int(entry.name) == os.getpid():
            continue
        try:
            cwd = os.path.realpath(os.readlink(entry / "cwd"))
        except OSError:  # gone, or not ours to read
            continue
        if cwd == target or cwd.startswith(target + os.sep):
            found.append(int(entry.name))
    return found


def clear_stale_build_locks(
    root: Path | None = None,
    *,
    report: Callable[[str], None] | None = None,
    stale_after_s: float = STALE_LOCK_AGE_S,
    poll_s: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Path]:
    """Clear the ``lock`` files of torch extension builds that no running build holds; returns the removed ones.

    A DeepSpeed op build killed half-way (e.g. the first ``zero3_nvme`` run stopped while it compiles ``async_io``)
    leaves torch's ``lock`` behind, and every later run would wait on it forever without a word. A lock with a
    process building beside it belongs to a live build: torch waits for it, and ``report`` says so. A lock with no
    builder is removed once it is ``stale_after_s`` old (younger ones are waited for, with one ``report`` line naming
    the file, since a build may be between two steps). Locks younger than 10 s are another process loading or building
    an op right now and get no message. ``report`` defaults to a ``UserWarning``.
    """
    if report is None:

        def report(message: str) -> None:
            warnings.warn(message, UserWarning, stacklevel=3)

    root = torch_extensions_root() if root is None else root
    removed: list[Path] = []
    for lock in sorted({*root.glob("*/lock"), *root.glob("*/*/lock")}):
        announced = False
        while lock.exists():
            try:
                age = time.time() - lock.stat().st_mtime
            except FileNotFoundError:
                break
            builders = _processes_building_in(lock.parent)
            if builders:
                if age >= _QUIET_S:  # torch also takes the lock to check an up-to-date op: only real builds are told
                    report(
                        f"lightspeed: waiting for the build of DeepSpeed op {lock.parent.name!r} by process "
                        f"{builders[0]} (lock {str(lock)!r})."
                    )
                break  # torch's own lock waits for it
            if age >= stale_after_s:
                lock.unlink(missing_ok=True)
                report(
                    f"lightspeed: removed the stale build lock {str(lock)!r}: a build of DeepSpeed op "
                    f"{lock.parent.name!r} was killed half-way and no process is building it; it is built again now."
                )
                removed.append(lock)
                break
            if not announced and age >= _QUIET_S:
                report(
                    f"lightspeed: waiting for the build lock {str(lock)!r}: no process is building DeepSpeed op "
                    f"{lock.parent.name!r}; the lock is removed once it is {stale_after_s:.0f} s old."
                )
                announced = True
            sleep(poll_s)
    return removed


def torch_extensions_root() -> Path:
    """The directory torch's JIT builds extensions under right now: ``TORCH_EXTENSIONS_DIR`` (ops in ``<dir>/<op>``),
    else torch's default cache root (ops in ``<root>/<python-and-device tag>/<op>``)."""
    configured = os.environ.get(TORCH_EXTENSIONS_ENV)
    if configured is not None:
        return Path(configured)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def export_deepspeed_accelerator(kind: str) -> None:
    """Set ``DS_ACCELERATOR`` so that ranks started from this process pick ``kind`` (``"cpu"`` or ``"cuda"``)."""
    if kind not in DEVICE_KINDS:
        raise ValueError(f"DeepSpeed device kind must be one of {DEVICE_KINDS}, got {kind!r}.")
    os.environ["DS_ACCELERATOR"] = kind


def use_deepspeed_accelerator(kind: str) -> None:
    """Make DeepSpeed's cached accelerator ``kind`` in this process; a no-op when it already is.

    On CPU this never touches CUDA: DeepSpeed's CPU accelerator is built directly.
    """
    export_deepspeed_accelerator(kind)
    honour_explicit_zero_init_dtype()
    from deepspeed.accelerator import real_accelerator

    current = real_accelerator.ds_accelerator
    if current is not None and current._name == kind:
        return
    if kind == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        real_accelerator.set_accelerator(CPU_Accelerator())
    else:
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

        real_accelerator.set_accelerator(CUDA_Accelerator())


def zero_device_kind(accelerator: object) -> str:
    """``"cuda"`` or ``"cpu"`` for a Lightning accelerator (Trainer's or Fabric's, recognised by class name so that
    core stays free of Lightning); any other accelerator is an error: ZeRO runs on CUDA and on the CPU only."""
    names = {cls.__name__ for cls in type(accelerator).__mro__}
    if "CUDAAccelerator" in names:
        return "cuda"
    if "CPUAccelerator" in names:
        return "cpu"
    raise DeepSpeedConfigError(
        f"ZeRO strategies run on `accelerator='cuda'` or `accelerator='cpu'`, not on `{type(accelerator).__name__}`."
    )


def check_device_of_local_rank(device: Any, local_rank: int) -> None:
    """On CUDA, a process of local rank ``i`` trains on ``cuda:i`` (DeepSpeed selects its device by the local rank, as
    Lightning requires); choosing other GPUs is done with ``CUDA_VISIBLE_DEVICES``."""
    if device.index != local_rank:
        raise DeepSpeedConfigError(
            f"The process of local rank {local_rank} was given {device}, but ZeRO trains local rank {local_rank} on "
            f"cuda:{local_rank}. Choose the GPUs with CUDA_VISIBLE_DEVICES instead of the device indices (e.g. "
            f"CUDA_VISIBLE_DEVICES={device.index} for this one) and pass devices=<how many>."
        )


def check_precision_supported(kind: str, precision: str) -> None:
    """Refuse a Lightning ``precision`` that DeepSpeed cannot train in on device ``kind`` (``"cpu"``/``"cuda"``)."""
    import torch

    if kind == "cpu" and precision in ("16-mixed", "16-true"):
        raise DeepSpeedConfigError(
            f"`precision={precision!r}` needs a CUDA GPU: DeepSpeed's CPU accelerator trains in float32 or "
            "bfloat16. Use `precision='bf16-mixed'` or `'32-true'` on the CPU."
        )
    if kind == "cuda" and precision.startswith("bf16") and torch.cuda.is_available():
        if not torch.cuda.is_bf16_supported():
            raise DeepSpeedConfigError(
                f"`precision={precision!r}` needs a GPU with bfloat16 support (Ampere or newer); this GPU has "
                "none. Use `precision='16-mixed'` or `'32-true'`."
            )


def deepspeed_device_rank(device_index: int | None, local_rank: int) -> int:
    """The ``device_rank`` DeepSpeed's engine expects: the CUDA index, or the local rank on CPU (never None)."""
    return local_rank if device_index is None else device_index


def async_io_problem() -> str | None:
    """Why NVMe offload cannot run here (DeepSpeed's async_io op), or None when it can."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if AsyncIOBuilder().is_compatible(verbose=False):
            return None
    except Exception as err:  # noqa: BLE001 - any import/build probe failure means "not usable"
        return f"DeepSpeed's async_io op cannot be loaded ({err})."
    return (
        "DeepSpeed's async_io op is not available: it needs the libaio development files. "
        "Install them with `apt-get install libaio-dev` (Debian/Ubuntu) and run again."
    )


def honour_explicit_zero_init_dtype() -> None:
    """Make ``deepspeed.zero.Init(dtype=...)`` keep the dtype it is given on every accelerator (idempotent).

    DeepSpeed ignores an explicit ``dtype`` when its accelerator reports no float16 support (``dtype or float16 if
    fp16 else bfloat16 ...`` binds as ``(dtype or float16) if fp16 else ...``), which is the case for its CPU
    accelerator on most CPUs. ZeRO-3 converts a model built outside ``zero.Init`` with ``dtype=<the model's dtype>``,
    so a float32 run on such a CPU got bfloat16 NVMe parameter swap buffers. With this in place the explicit dtype is
    used and DeepSpeed's own rule still applies when none is given.
    """
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Init

    original = Init._set_dtype
    if getattr(original, "_lightspeed_explicit_dtype", False):
        return

    def _set_dtype(self: Any, ds_config: Any, dtype: Any) -> None:
        if dtype is not None:
            self.dtype = dtype
            return
        original(self, ds_config, dtype)

    _set_dtype._lightspeed_explicit_dtype = True  # type: ignore[attr-defined]
    Init._set_dtype = _set_dtype
