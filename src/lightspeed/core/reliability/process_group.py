"""The default process group that a lightspeed strategy (Trainer or Fabric) creates, and tearing it down with
DeepSpeed's cached state.

Creating it (:func:`lightspeed_process_group` around the front end's own set-up, for the ZeRO and ``ddp_exact``
strategies, before Lightning or DeepSpeed would): the ``env://`` store gets a key prefix per ``torchrun`` restart
attempt, so a restarted job never reads the peer addresses of the attempt that died, and every rank runs a heartbeat
so that a collective that times out names the ranks that stopped answering (:func:`explain_timeout`,
:mod:`lightspeed.core.reliability.hang_report`). The timeout is the strategy's ``timeout=`` (default 30 minutes,
Lightning's), also for the groups DeepSpeed creates.

A process group left alive until interpreter exit is destroyed while Python tears down its modules; gloo's (and
NCCL's) native threads are then sometimes still running, and the process ends with ``terminate called without an
active exception`` (exit code -6) after a successful run; the same happens when the heartbeat thread is inside a
store write at that moment. lightspeed therefore stops and joins the heartbeat and destroys the group it created in
an ``atexit`` hook, which runs while the interpreter is still whole (and frees the groups that only garbage still
references, see :func:`_free_unreachable_groups`); not at the end of a run, since the training engine
kept for evaluation, ZeRO-3 partitioned modules and the user's own ``torch.distributed`` calls after ``fit`` (even a
failed one) still use it. A group someone else created (Ray Train's) is only watched: a heartbeat of lightspeed's
own, so that its timeouts are named too (:func:`monitor_adopted_group`); at exit, once ``import lightspeed`` has run,
a gloo one is destroyed the same way (:func:`release_other_gloo_group`).
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightspeed.core.common.process import RankedProcess
from lightspeed.core.errors import CollectiveTimeoutError, RankLostError
from lightspeed.core.reliability import hang_report
from lightspeed.core.reliability.host_address import check_host_addresses

__all__ = [
    "DEFAULT_TIMEOUT",
    "apply_timeout_to_deepspeed_groups",
    "destroy_owned_group",
    "explain_timeout",
    "group_is_initialized",
    "init_process_group",
    "lightspeed_process_group",
    "monitor_adopted_group",
    "register_exit_cleanup",
    "release_other_gloo_group",
    "restart_prefix",
    "set_rendezvous_environment",
    "set_position",
    "take_ownership",
    "timeouts_explained",
]

log = logging.getLogger(__name__)

_owned = False
_hook_registered = False
_other_hook_registered = False


def group_is_initialized() -> bool:
    """True when the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def take_ownership() -> None:
    """Record that lightspeed created the default process group (it destroys it at the latest at exit)."""
    global _owned, _hook_registered
    _owned = True
    if not _hook_registered:
        # registered now, when lightspeed creates its group: the exit hooks registered later (DeepSpeed's, the
        # user's) run before it, the ones of the imports before after it, as they always did
        atexit.register(destroy_owned_group)
        _hook_registered = True


def register_exit_cleanup() -> None:
    """Run :func:`release_other_gloo_group` when the interpreter exits (idempotent; ``import lightspeed`` calls it)."""
    global _other_hook_registered
    if not _other_hook_registered:
        atexit.register(release_other_gloo_group)
        _other_hook_registered = True


def release_other_gloo_group() -> None:
    """At interpreter exit, while it is still whole: a gloo default group that lightspeed did not create (Lightning's
    ``ddp`` beside a lightspeed callback) is destroyed as lightspeed's own is (:func:`destroy_owned_group`), with the
    garbage that still holds groups collected, so no gloo worker thread is left for finalization (see
    :func:`_free_unreachable_groups`). lightspeed's own group is gone by then; another backend's group is left alone:
    destroying an NCCL group can wait for peers that are gone."""
    if not _owned and group_is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()
        _free_unreachable_groups()


def destroy_owned_group() -> None:
    """Destroy the default process group if lightspeed created it, and reset DeepSpeed's communication state so the
    next ``deepspeed.init_distributed`` (the next ``fit``/``validate``) creates everything afresh."""
    global _owned
    if not _owned:
        return
    _owned = False
    _stop_heartbeat()
    if not group_is_initialized():
        _free_unreachable_groups()
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
    _free_unreachable_groups()
    log.debug("lightspeed destroyed the default process group it created")


def _free_unreachable_groups() -> None:
    """Collect the garbage that still holds process groups (a finished Trainer's engine and optimizer reference
    cycles) now, while the interpreter is whole.

    ``destroy_process_group`` only forgets the groups; a gloo group's C++ object, and its worker threads, live until
    its last Python reference goes. Left to the collection inside interpreter finalization, a worker still releasing
    its last collective's tensors needs the GIL then, and CPython ends such a thread by unwinding through C++ frames
    that may not throw: ``terminate called without an active exception`` (exit code -6) after a successful run (seen
    in a core dump: ``AsyncAllgatherWork``'s destructor on a ``pt_gloo_runloop`` thread, the main thread in
    ``Py_FinalizeEx``'s collection; pytorch/pytorch#190489). Groups still referenced by live objects are out of reach.
    """
    gc.collect()


# ---------------------------------------------------------------------------------------- creating the process group
#: the process group's timeout when the strategy gets ``timeout=None`` (Lightning's default is the same)
DEFAULT_TIMEOUT = timedelta(minutes=30)
#: longest a heartbeat write (or the hang report's read) may wait for the store
HEARTBEAT_STORE_TIMEOUT = timedelta(seconds=20)
#: where a collective's timeout came from, as CollectiveTimeoutError says it: lightspeed's group, a group adopted
STRATEGY_TIMEOUT = "the strategy's `timeout=`"
ADOPTED_GROUP_TIMEOUT = (
    "the timeout of the process group, which was created outside lightspeed: under Ray Train set it with "
    "TorchConfig(timeout_s=...)"
)


def restart_prefix() -> str:
    """Store prefix of this launch attempt: ``TORCHELASTIC_RESTART_COUNT`` under torchrun, else ``0``."""
    return f"lightspeed/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def set_rendezvous_environment(process: RankedProcess, *, rank_variables: bool) -> None:
    """Where rank 0's store listens (``MASTER_ADDR``/``MASTER_PORT`` of the ``env://`` rendezvous), from the front
    end's cluster environment, before :func:`init_process_group`; with ``rank_variables`` also ``RANK``,
    ``WORLD_SIZE`` and ``LOCAL_RANK``, which DeepSpeed reads."""
    environment: Any = process.cluster_environment
    os.environ["MASTER_ADDR"] = environment.main_address
    os.environ["MASTER_PORT"] = str(environment.main_port)
    if rank_variables:
        os.environ["RANK"] = str(process.global_rank)
        os.environ["WORLD_SIZE"] = str(process.world_size)
        os.environ["LOCAL_RANK"] = str(process.local_rank)


def init_process_group(backend: str, rank: int, world_size: int, timeout: timedelta | None) -> None:
    """Create the default process group over ``MASTER_ADDR:MASTER_PORT`` (the ``env://`` rendezvous), with every key
    under a prefix of its own per restart attempt, and start this rank's heartbeat.

    torchrun keeps one store for all attempts of a job; without the prefix, the workers of a restarted attempt can
    read the peer addresses the dead attempt left there and hang or fail with ``connectFullMesh ... Connection
    refused``. Does nothing when a default group exists. Callers set ``MASTER_ADDR``/``MASTER_PORT`` first.
    """
    if group_is_initialized():
        return
    timeout = timeout or DEFAULT_TIMEOUT
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    prefix = restart_prefix()
    this_host = _ranks_on_this_host(rank)
    if backend == "gloo" and world_size > 1 and (this_host is None or len(this_host) < world_size):
        # only a job over several hosts (or where the launcher does not say) can have a host the others cannot reach
        check_host_addresses(dist.PrefixStore(prefix, store), rank, world_size, timeout)
    dist.init_process_group(
        backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size, timeout=timeout
    )
    take_ownership()
    if world_size > 1:
        client = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        _start_heartbeat(dist.PrefixStore(prefix, client), rank, world_size, timeout, STRATEGY_TIMEOUT)
    log.debug("lightspeed created the default process group (store prefix %s)", prefix)


def monitor_adopted_group() -> None:
    """Start this rank's heartbeat in a default group someone else created (Ray Train creates the workers' group),
    on its own connection to that group's store, so that its collective timeouts are named as in lightspeed's own
    group (:func:`explain_timeout`); the timeout is the group's. Does nothing when the group is already watched, has
    one rank, or its store cannot open a second connection (then timeouts stay the backend's bare errors)."""
    global _heartbeat_hook_registered
    if not group_is_initialized() or dist.get_world_size() < 2:
        return
    group = id(dist.distributed_c10d._get_default_group())
    if _monitor.get("adopted") == group or (_monitor and _owned):
        return
    _stop_heartbeat()  # the adopted group it watched was destroyed, this is another one
    store: Any = dist.distributed_c10d._get_default_store()  # clone() and timeout are not in its stubs
    try:
        client = store.clone()
    except (RuntimeError, NotImplementedError) as unsupported:  # a store of the user's own kind
        log.debug("lightspeed does not watch this process group: its store cannot be cloned (%s)", unsupported)
        return
    timeout = _adopted_group_timeout(store.timeout)
    _start_heartbeat(client, dist.get_rank(), dist.get_world_size(), timeout, ADOPTED_GROUP_TIMEOUT)
    _monitor["adopted"] = group
    if not _heartbeat_hook_registered:  # the group is not lightspeed's to destroy, the heartbeat is
        atexit.register(_stop_heartbeat)
        _heartbeat_hook_registered = True


def _adopted_group_timeout(store_timeout: timedelta) -> timedelta:
    """The default group's own timeout (its backend's options: the collectives' limit), else its store's (the same
    under an ``env://`` or ``tcp://`` rendezvous, as Ray's)."""
    group: Any = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError, ValueError):  # no backend for that device, or no options to read
            continue
    return store_timeout


def _start_heartbeat(store: Any, rank: int, world_size: int, timeout: timedelta, timeout_source: str) -> None:
    """This rank's heartbeat on ``store`` (a connection of its own) and what :func:`explain_timeout` needs."""
    global _heartbeat
    interval = hang_report.heartbeat_interval(timeout)
    # a heartbeat write never waits long: a stalled store must not hold up the join at exit (see Heartbeat.stop)
    store.set_timeout(min(timeout, HEARTBEAT_STORE_TIMEOUT))
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}" if "MASTER_PORT" in os.environ else ""
    _monitor.update(
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        timeout_source=timeout_source,
        interval=interval,
        same_host=_ranks_on_this_host(rank),
        store_address=address,
    )
    _heartbeat = hang_report.Heartbeat(store, rank, interval, _position_text).start()


def _stop_heartbeat() -> None:
    """Stop and join this rank's heartbeat (before its group goes) and forget the group it watched."""
    global _heartbeat
    if _heartbeat is not None:
        # a host cut off from the store: its heartbeat thread waits on the store client, which a stuck read holds
        _heartbeat.stop(wait=0 if _monitor.get("store_lost") else HEARTBEAT_STORE_TIMEOUT.total_seconds() + 1)
        _heartbeat = None
    _monitor.clear()


def _ranks_on_this_host(rank: int) -> range | None:
    """The global ranks this host runs, from the launcher's ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (torchrun, SLURM
    through Lightning: consecutive per host); None when the launcher does not say."""
    try:
        local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    first = rank - local_rank
    return range(first, first + local_world)


_heartbeat: hang_report.Heartbeat | None = None
_heartbeat_hook_registered = False
_monitor: dict[str, Any] = {}
_position: tuple[weakref.ref, Callable[[Any], str]] | None = None


def set_position(run: object, describe: Callable[[Any], str]) -> None:
    """Where this rank is, published with its heartbeat: ``describe(run)`` (e.g. ``run`` a Trainer, ``describe``
    ``lambda trainer: f"step {trainer.global_step}"``). ``run`` is held weakly and ``describe`` must not hold it: a
    finished run's Trainer, and the model and engines it holds, stay collectable."""
    global _position
    _position = (weakref.ref(run), describe)


def _position_text() -> str:
    if _position is None:
        return ""
    run_ref, describe = _position
    run = run_ref()
    return describe(run) if run is not None else ""


@contextmanager
def lightspeed_process_group(
    process: RankedProcess, backend: str, timeout: timedelta | None, *, rank_variables: bool = False
) -> Iterator[None]:
    """Wrap a front end's process set-up: unless a default group exists, :func:`set_rendezvous_environment` and
    :func:`init_process_group` run first, so Lightning and DeepSpeed adopt lightspeed's group inside the block;
    afterwards the groups DeepSpeed created get ``timeout`` too. A group created outside lightspeed (Ray Train's) is
    left as it is but watched (:func:`monitor_adopted_group`), and DeepSpeed's groups get its timeout."""
    existed = group_is_initialized()
    if existed:
        monitor_adopted_group()
    else:
        set_rendezvous_environment(process, rank_variables=rank_variables)
        init_process_group(backend, process.global_rank, process.world_size, timeout)
    yield
    if "adopted" in _monitor:  # a watched group created outside lightspeed: its timeout for DeepSpeed's groups too
        apply_timeout_to_deepspeed_groups(_monitor["timeout"])
    if not existed and group_is_initialized():
        take_ownership()
        apply_timeout_to_deepspeed_groups(timeout)


@contextmanager
def timeouts_explained() -> Iterator[None]:
    """Re-raise a collective timeout in lightspeed's group as :class:`CollectiveTimeoutError` naming the collective
    and the ranks that stopped answering, and a collective ended by a rank that left as :class:`RankLostError` (see
    :func:`explain_timeout`); any other error passes unchanged."""
    try:
        yield
    except Exception as error:
        explained = explain_timeout(error)
        if explained is None:
            raise
        raise explained from error


def explain_timeout(error: BaseException) -> CollectiveTimeoutError | None:
    """A :class:`~lightspeed.errors.CollectiveTimeoutError` naming the collective and the ranks that did not arrive
    when ``error`` is a collective timeout in the group lightspeed created, a :class:`~lightspeed.errors.RankLostError`
    naming the rank that left when another rank's process ended during the collective, else None. Waits at most about
    two heartbeat intervals to tell stopped ranks from live ones; a signal handler that fails meanwhile (Lightning's
    SIGTERM handler broadcasts on the broken group when torchrun stops the job) only costs the details."""
    if not _monitor:
        return None
    store, world_size, rank, interval = (_monitor[key] for key in ("store", "world_size", "rank", "interval"))
    collective = hang_report.collective_name(error.__traceback__)
    read_deadline = min(_monitor["timeout"], HEARTBEAT_STORE_TIMEOUT).total_seconds()
    if hang_report.is_peer_lost(error):  # first: the other rank's timeout says 'timeout' too
        left, silent = {}, {}
        try:
            before = hang_report.heartbeats(store, world_size, read_deadline)
            left = hang_report.ranks_that_left(store, world_size, rank, 2 * interval + 1, read_deadline=read_deadline)
            if not left:  # two intervals passed: a rank killed outright marked nothing, and its heartbeat stood still
                silent = hang_report.silent_ranks(store, world_size, rank, before, read_deadline)
        except hang_report.StoreUnreachable:
            _monitor["store_lost"] = True
        except Exception:  # noqa: BLE001 - see the docstring
            pass
        return RankLostError(hang_report.peer_lost_message(rank, left, collective, error, silent))
    if hang_report.is_collective_timeout(error):
        try:
            stopped, notes = hang_report.describe_missing_ranks(
                store, world_size, rank, interval, _position_text(), read_deadline=read_deadline
            )
        except hang_report.StoreUnreachable as unreachable:
            _monitor["store_lost"] = True
            same_host = _monitor.get("same_host")
            stopped = [other for other in range(world_size) if other not in same_host] if same_host else []
            notes = hang_report.unreachable_store_note(_monitor["store_address"], unreachable.seconds, stopped)
        except Exception as interrupted:  # noqa: BLE001 - see the docstring
            stopped, notes = [], f"the other ranks' heartbeats could not be read: {interrupted}"
        return CollectiveTimeoutError(
            hang_report.timeout_message(
                error, _monitor["timeout"], _monitor["timeout_source"], rank, stopped, notes, collective
            )
        )
    return None


def apply_timeout_to_deepspeed_groups(timeout: timedelta | None) -> None:
    """Make the groups DeepSpeed creates (its data-parallel clone of the world group, ZeRO's partition groups) use
    ``timeout`` too: ``deepspeed.comm`` creates them with ``torch.distributed.new_group(ranks)``, which otherwise
    gets torch's 30-minute default and ignores the strategy's ``timeout=``. Changes only DeepSpeed's communication
    backend object of this process group."""
    import deepspeed.comm.comm as ds_comm_state

    backend = ds_comm_state.cdb
    if backend is None or timeout is None or getattr(backend, "_lightspeed_timeout", None) == timeout:
        return

    def new_group(ranks: Any) -> Any:
        return dist.new_group(ranks, timeout=timeout)

    backend.new_group = new_group
    backend._lightspeed_timeout = timeout
