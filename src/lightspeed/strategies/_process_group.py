"""The default process group that a ZeRO strategy created, and tearing it down with DeepSpeed's cached state.

A process group left alive until interpreter exit is destroyed while Python tears down its modules; gloo's (and
NCCL's) native threads are then sometimes still running, and the process ends with ``terminate called without an
active exception`` (exit code -6) after a successful run. lightspeed therefore destroys the group it created in an
``atexit`` hook, which runs while the interpreter is still whole; not at the end of a run, since the training engine
kept for evaluation, ZeRO-3 partitioned modules and the user's own ``torch.distributed`` calls after ``fit`` (even a
failed one) still use it. A group the user created is never touched.
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


def destroy_owned_group() -> None:
    """Destroy the default process group if lightspeed created it, and reset DeepSpeed's communication state so the
    next ``deepspeed.init_distributed`` (the next ``fit``/``validate``) creates everything afresh."""
    global _owned
    if not _owned:
        return
    _owned = False
    if not group_is_initialized():
        return
    try:
        import deepspeed.comm as ds_comm
        import deepspeed.comm.comm as ds_comm_state
    except ImportError:  # pragma: no cover - DeepSpeed is a dependency
        dist.destroy_process_group()
        return
    if ds_comm_state.cdb is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()  # also drops DeepSpeed's cached groups (deepspeed.utils.groups)
    if group_is_initialized():
        dist.destroy_process_group()
    ds_comm_state.cdb = None
    log.debug("lightspeed destroyed the default process group it created")
