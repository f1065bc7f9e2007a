"""What happens before a ZeRO checkpoint is loaded, and how it is loaded: the same for the Trainer's ``ckpt_path=``
and Fabric's ``fabric.load``.

* :func:`check_before_loading`: a missing checkpoint or an interrupted save is an error saying what to do; a
  truncated or replaced shard, another model (any parameter whose shape differs), or a node-local checkpoint whose
  nodes hold parts of different saves is one error raised on every rank, before anything is loaded or any step runs.
* :func:`checkpoint_to_load`: the directory DeepSpeed's ``load_checkpoint`` should read. A checkpoint written by
  another number of processes is converted to DeepSpeed's universal format beside it (rank 0), loaded by every
  rank into its own partition, and the converted copy removed afterwards.
* :func:`load_weights_for_evaluation`: weights only, from the rank files of any stage and world size, tensor by
  tensor into a (possibly partitioned) model without a ZeRO optimizer.

Every function is a collective where it says so: every rank calls it with the same path.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lightspeed.core.common.distributed import global_rank, is_distributed, raise_on_every_rank
from lightspeed.core.errors import CheckpointError, IncompleteCheckpointError
from lightspeed.core.reliability import reshard
from lightspeed.core.reliability import staging as atomic_dir
from lightspeed.core.reliability.node_local import require_part as require_node_local_part
from lightspeed.core.zero.engine import CHECKPOINT_TAG, FROZEN_EXCLUDED_KEY, check_loadable
from lightspeed.core.zero.frozen_fingerprint import FINGERPRINT_KEY, check_frozen_fingerprint
from lightspeed.core.zero.nvme_checkpoints import check_nvme_layout
from lightspeed.core.zero.weights import check_fits, load_zero_weights, read_client_state, read_structure

__all__ = [
    "check_before_loading",
    "checkpoint_to_load",
    "deepspeed_strict",
    "frozen_parameters_excluded",
    "load_models",
    "load_weights_for_evaluation",
    "models_in_checkpoint",
]


def _what(path: Path) -> str:
    return f"Loading checkpoint {str(path)!r}"


def check_before_loading(
    path: str | os.PathLike[str],
    *,
    module: torch.nn.Module | None,
    strict: bool = True,
    node_rank: int | None = None,
    warn: Callable[[str], None],
    marked: bool = True,
    frozen_excluded: bool | None = None,
) -> None:
    """Every check that can fail before a checkpoint is loaded (a collective).

    ``module`` (None: no shape check) is compared with the checkpoint's parameter shapes; ``strict`` also refuses
    parameters missing on either side. ``node_rank`` (node-local storage) checks this node's part and that every node
    holds the same save. A plain DeepSpeed checkpoint without lightspeed's completion marker is loaded after
    ``warn`` says so. ``marked=False``: one model's folder of a several-model checkpoint, whose marker
    :func:`models_in_checkpoint` checked; only the shapes are compared. Frozen parameters may be missing where the
    save left them out (``frozen_excluded``; None: as the checkpoint's manifest says)."""
    path = Path(path)
    if node_rank is not None:
        _check_node_local_part(path, node_rank)
        return
    if marked:
        _check_marked(path, warn)
    excluded = frozen_parameters_excluded(path) if frozen_excluded is None else frozen_excluded
    _check_fits_on_every_rank(path, module, strict, excluded)


def _check_marked(path: Path, warn: Callable[[str], None]) -> None:
    warning = check_loadable(path)  # missing or interrupted: an error explaining it
    if warning is not None:
        warn(warning)
    if path.is_dir() and atomic_dir.is_complete(path):
        several = atomic_dir.several_models_in(path)
        if several:
            raise CheckpointError(
                f"{_what(path)}: it holds several models, each with its own engine ({', '.join(several)}); load it "
                "with the strategy that wrote it: ZeroStrategy(models=...) or one fabric.setup per model."
            )
        _require_intact_on_every_rank(path)


def _manifest(path: Path) -> dict[str, Any]:
    return dict(json.loads((path / atomic_dir.COMPLETE_MARKER).read_text()))


def models_in_checkpoint(
    path: str | os.PathLike[str], trained: list[str], known: list[str], world_size: int | None = None
) -> list[str]:
    """The models a several-model checkpoint holds, after the checks of :func:`check_before_loading` on the whole
    checkpoint and a check that it holds exactly the models ``trained`` (resuming), or only models among ``known``
    (evaluation, ``trained`` empty), written by ``world_size`` processes when given (resharding several models is
    not supported yet). A collective: one error on every rank."""
    path = Path(path)
    _check_several(path)
    error: CheckpointError | None = None
    held: dict[str, Any] = {}
    try:
        manifest = _manifest(path)
        held = manifest.get(atomic_dir.MODELS_MANIFEST_KEY) or {}
        if not held:
            raise CheckpointError(
                f"{_what(path)}: it holds one model trained with one engine, but this run has "
                f"{', '.join(trained or known)} with one engine each. Load it without models=."
            )
        if (sorted(held) != sorted(trained)) if trained else not set(held) <= set(known):
            this_run = f"trains {', '.join(sorted(trained))}" if trained else f"has {', '.join(sorted(known))}"
            raise CheckpointError(
                f"{_what(path)}: it holds the trained models {', '.join(sorted(held))}, but this run {this_run}. "
                "Name the same models in models= and give them optimizers as the run that wrote it did."
            )
        saved = manifest.get("world_size")
        if world_size is not None and saved is not None and int(saved) != world_size:
            raise CheckpointError(
                f"{_what(path)}: it was written by {saved} processes and this run has {world_size}; a checkpoint of "
                f"several models resumes on {saved} processes only (resharding it is not supported yet). Resume on "
                f"{saved} processes, or export it (`lightspeed export`) and load the weights."
            )
    except CheckpointError as err:
        error = err
    raise_on_every_rank(error, _what(path), error_type=CheckpointError)
    return list(held)


def load_models(
    path: str | os.PathLike[str],
    modules: dict[str, torch.nn.Module],
    engines: dict[str, Any] | None,
    *,
    trained: list[str],
    world_size: int | None,
    strict: bool,
    rank: int,
    warn: Callable[[str], None],
    load_optimizer_states: bool = True,
) -> dict[str, Any]:
    """Load a several-model checkpoint into the run's models (a collective): checked first as a whole
    (:func:`models_in_checkpoint`, ``modules`` naming the run's models) and each model's folder against its module;
    then each model's engine loads its folder (``engines``: resuming), or without engines each folder's weights go
    into the (possibly partitioned) module (evaluation, any world size). Returns the client state saved with the first
    model."""
    path = Path(path)
    held = models_in_checkpoint(path, trained, list(modules), world_size)
    excluded = frozen_parameters_excluded(path)
    client_state: dict[str, Any] = {}
    for index, name in enumerate(held):
        folder = path / name
        check_before_loading(
            folder, module=modules[name], strict=strict, warn=warn, marked=False, frozen_excluded=excluded
        )
        if engines is None:
            state = load_weights_for_evaluation(
                modules[name], folder, rank=rank, strict=strict, frozen_excluded=excluded
            )
        else:
            _, state = engines[name].load_checkpoint(
                str(folder),
                tag=CHECKPOINT_TAG,
                load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=False,
                load_module_strict=strict and not excluded,
            )
        if index == 0:
            client_state = dict(state or {})
    return client_state


def _check_several(path: Path) -> None:
    check_loadable(path)
    if not atomic_dir.is_complete(path):
        raise CheckpointError(
            f"{_what(path)}: a checkpoint of several models must carry lightspeed's completion marker "
            f"({atomic_dir.COMPLETE_MARKER}); this one was not written by ZeroStrategy(models=...)."
        )
    _require_intact_on_every_rank(path)


def _require_intact_on_every_rank(path: Path) -> None:
    damaged: IncompleteCheckpointError | None = None
    try:
        atomic_dir.require_intact(path, include_missing=False)  # a truncated shard: error on every rank
    except IncompleteCheckpointError as err:
        damaged = err
    raise_on_every_rank(damaged, _what(path), error_type=IncompleteCheckpointError)


def _check_fits_on_every_rank(path: Path, module: torch.nn.Module | None, strict: bool, frozen_excluded: bool) -> None:
    if module is not None and path.is_dir():
        misfit: CheckpointError | None = None
        fingerprint = None
        try:
            structure = read_structure(path)
            check_fits(module, structure, strict=strict, frozen_excluded=frozen_excluded)
            if frozen_excluded:
                fingerprint = read_client_state(structure).get(FINGERPRINT_KEY)
        except CheckpointError as err:
            misfit = err
        raise_on_every_rank(misfit, _what(path), error_type=CheckpointError)
        _check_frozen_kept(module, path, fingerprint)


def _check_frozen_kept(module: torch.nn.Module, path: Path, fingerprint: dict[str, list[float]] | None) -> None:
    """The module's frozen parameters are those the checkpoint (which left them out) was saved with: one error on
    every rank otherwise. Every rank has read the same fingerprint, so every rank takes part in its collective."""
    if fingerprint is None:
        return
    check_frozen_fingerprint(module, fingerprint, str(path))


def frozen_parameters_excluded(path: str | os.PathLike[str]) -> bool:
    """Whether the save of ``path`` left frozen parameters out (lightspeed's manifest says so)."""
    path = Path(path)
    return path.is_dir() and atomic_dir.is_complete(path) and bool(_manifest(path).get(FROZEN_EXCLUDED_KEY))


def deepspeed_strict(path: str | os.PathLike[str], strict: bool) -> bool:
    """The ``load_module_strict`` for DeepSpeed's ``load_checkpoint`` of ``path``, once :func:`check_before_loading`
    passed: not strict where the save left frozen parameters out (checked already, they keep their built values)."""
    return strict and not frozen_parameters_excluded(path)


def _check_node_local_part(path: Path, node_rank: int) -> None:
    what = f"Loading node-local checkpoint {str(path)!r}"
    error: CheckpointError | None = None
    save_id = None
    try:
        save_id = require_node_local_part(path, node_rank).save_id
    except CheckpointError as err:
        error = err
    raise_on_every_rank(error, what, error_type=CheckpointError)
    ids: list[Any] = [save_id]
    if is_distributed():
        ids = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ids, save_id)
    if len(set(ids)) > 1:
        raise CheckpointError(
            f"{what}: the nodes hold parts of different saves (a node did not commit the latest one); resume from an "
            "earlier checkpoint, or copy the matching directories back."
        )


@contextmanager
def checkpoint_to_load(
    engine: Any, path: str | os.PathLike[str], world_size: int, *, info: Callable[[str], None]
) -> Iterator[str]:
    """Yield the directory ``engine.load_checkpoint`` reads for ``path`` (a collective).

    When lightspeed's marker says ``path`` was written by another number of processes, rank 0 converts it to
    DeepSpeed's universal format (weights and optimizer states, one parameter at a time) beside it, the engine is
    switched to universal loading while the caller loads, and the converted copy is deleted afterwards; ``info`` is
    told. Otherwise ``path`` itself is yielded."""
    path = Path(path)
    check_nvme_layout(engine, path, CHECKPOINT_TAG, world_size)  # before any resharding (the engine checks too)
    saved = reshard.saved_world_size(path) if path.is_dir() else None
    if saved is None or saved == world_size:
        yield str(path)
        return
    _refuse_lossy_resharding(engine, path, saved, world_size)
    error: Exception | None = None
    if global_rank() == 0:
        try:
            reshard.convert_to_universal(path, "checkpoint")
        except Exception as err:  # noqa: BLE001 - re-raised here, reported on the other ranks
            error = err
    raise_on_every_rank(error, f"Resharding checkpoint {str(path)!r}", error_type=CheckpointError)
    engine._config.load_universal_checkpoint = True
    try:
        yield str(reshard.universal_path(path))
    finally:
        engine._config.load_universal_checkpoint = False
        if is_distributed():
            torch.distributed.barrier()
        if global_rank() == 0:
            reshard.remove_universal(path)
    info(
        f"lightspeed: checkpoint {str(path)!r} was written by {saved} processes, this run has {world_size}: "
        "converted it through DeepSpeed's universal checkpoint format (weights and optimizer states) and loaded it."
    )


def _refuse_lossy_resharding(engine: Any, path: Path, saved: int, world_size: int) -> None:
    """Raise :class:`CheckpointError` (every rank alike) where a resharded load would not restore ``engine`` exactly:
    with half-precision master weights and fp32 optimizer moments DeepSpeed's universal load builds the moments in the
    master weights' dtype, so they come back rounded."""
    half_masters = engine.bf16_master_weights_and_gradients() or engine.fp16_master_weights_and_gradients()
    if half_masters and not engine.bf16_optimizer_states():
        raise CheckpointError(
            f"Resuming from {str(path)!r}: the checkpoint was written by {saved} processes and this run has "
            f"{world_size}, with half-precision master weights and fp32 optimizer moments "
            "(bf16_master_weights_and_grads without bf16_optimizer_states), which DeepSpeed's resharded load rounds "
            f"to the master weights' precision. Resume on {saved} processes, or export its weights (`lightspeed "
            "export`) and start a new run from them."
        )


def load_weights_for_evaluation(
    module: torch.nn.Module,
    path: str | os.PathLike[str],
    *,
    rank: int,
    strict: bool = True,
    frozen_excluded: bool | None = None,
) -> dict[str, Any]:
    """Evaluation from a ZeRO checkpoint (a collective): its weights, read from the rank files of any stage and world
    size, go straight into the (possibly partitioned) ``module``, tensor by tensor; returns the client state saved
    beside them (the Trainer's loop state, Fabric's user state).

    DeepSpeed's inference engine has no ZeRO optimizer to restore shards into, so its ``load_checkpoint`` cannot be
    used; every rank reads the checkpoint's layout, so a missing rank file is an error on every rank. Frozen
    parameters the save left out (``frozen_excluded``; None: as the manifest says) keep their values."""
    path = Path(path)
    if frozen_excluded is None:
        frozen_excluded = frozen_parameters_excluded(path)
    error: CheckpointError | None = None
    client_state: dict[str, Any] = {}
    structure = None
    try:
        structure = read_structure(path)
        client_state = read_client_state(structure)
    except CheckpointError as err:
        error = err
    raise_on_every_rank(error, _what(path), error_type=CheckpointError)
    assert structure is not None
    if frozen_excluded:
        _check_frozen_kept(module, path, client_state.get(FINGERPRINT_KEY))
    try:
        load_zero_weights(module, structure, rank=rank, strict=strict, frozen_excluded=frozen_excluded)
    except CheckpointError as err:
        error = err
    raise_on_every_rank(error, _what(path), error_type=CheckpointError)
    return client_state
