"""The default process group that a ZeRO strategy created, and tearing it down with DeepSpeed's cached state.

A process group left alive until interpreter exit is destroyed while Python tears down its modules; gloo's (and
NCCL's) native threads are then sometimes still running, and the process ends with ``terminate called without an
active exception`` (exit code -6) after a successful run. lightspeed therefore destroys the group it created as
soon as nothing can use it any more (the strategy's teardown) and at the latest in an ``atexit`` hook, which runs
while the interpreter is still whole. A group the user created is never touched.
"""

from __future__ import annotations

import atexit
import logging

import torch.distributed as dist

__all__ = ["destroy_owned_group", "group_is_initialized", "take_ownership"]

log = logging.getLogger(__name__)

_owned = False
_hook_registered = False


def group_is_initialized() -> bool:
    """True when the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def take_ownership() -> None:
    """Record that lightspeed created the default process group (it destroys it at the latest at exit)."""
    global _owned, _hook_registered
    _owned = True
    if not _hook_registered:
        atexit.register(destroy_owned_group)
        _hook_registered = True


def owns_group() -> bool:
    """True while the default process group exists and lightspeed created it."""
    return _owned and group_is_initialized()


def destroy_owned_group() -> None:
    """Destroy the default process group if lightspeed created it, and reset DeepSpeed's communication state so the
    next ``deepspeed.init_distributed`` (the next ``fit``/``validate``) creates everything afresh."""
    global _owned
    if not _owned:
        return
    _owned = False
    if not group_is_initialized():
        return
    count = _group_count()
    try:
        import deepspeed.comm as ds_comm
        import deepspeed.comm.comm as ds_comm_state
    except ImportError:  # pragma: no cover - DeepSpeed is a dependency
        dist.destroy_process_group()
        _restore_group_count(count)
        return
    if ds_comm_state.cdb is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()  # also drops DeepSpeed's cached groups (deepspeed.utils.groups)
    if group_is_initialized():
        dist.destroy_process_group()
    ds_comm_state.cdb = None
    _restore_group_count(count)
    log.debug("lightspeed destroyed the default process group it created")


def _group_count() -> int | None:
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    count = getattr(world, "group_count", None)
    return count if isinstance(count, int) else None


def _restore_group_count(count: int | None) -> None:
    """Keep torch's process-group counter where it was: ``destroy_process_group`` resets it, and the next default
    group would be named ``0`` again. Its store keys (``default_pg/0/...``) are still in a store that outlives the
    group (torchrun's agent store), so a rank could read the previous group's addresses and fail to connect
    ("Gloo connectFullMesh failed ... Connection refused"). Every rank destroys at the same point with the same
    count, so the new names agree across ranks."""
    if count is None:
        return
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    if world is not None and getattr(world, "group_count", None) == 0:
        world.group_count = count
