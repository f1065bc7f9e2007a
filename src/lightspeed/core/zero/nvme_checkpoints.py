"""Checkpoints with anything on NVMe under ZeRO-3, saved and resumed exactly: the optimizer states (``zero3_nvme``)
or the parameters.

DeepSpeed 0.19 saves a run with its optimizer states on NVMe by copying its whole swap folder into the checkpoint
(``<tag>/offloaded_tensors/rank<NN>``) beside the ZeRO shard, in which every swapped tensor is an empty placeholder.
The files are named after DeepSpeed's parameter ids, which count every parameter the process built, so the folder
also holds the files of any earlier engine in the process (a second fit, a Fabric loop that builds its model again to
load), and each checkpoint carried them all. Its ``load_checkpoint`` skips the shard, copies the folder back and
restores only part of the state: the swapper reads back the fp32 weights of each swapped sub-group, by this engine's
ids, but not its optimizer states (an engine that has not stepped registers none, so the moments start from zero
again), and what is not swapped (sub-groups under the swapper's 1 MiB minimum), the step counts, the param groups'
hyperparameters and the loss scale are not read at all: a resumed run continued from other states (measured: a full
fine-tune 0.15 off the uninterrupted run two steps later, LoRA 1.3e-4, a small MLP 5e-3). With the parameters on NVMe
and the optimizer states elsewhere, DeepSpeed's restore writes the loaded weights into bit16 partitions that are on
NVMe, not in memory, and fails (``'NoneType' object has no attribute 'data'``).

:func:`install_nvme_checkpoints` (every trained engine, when it is built) makes ``engine.save_checkpoint`` copy only
this engine's swap files, and ``engine.load_checkpoint`` exact for both cases: DeepSpeed reads the ZeRO shards as it
does without NVMe, and lightspeed restores every sub-group from them itself, one at a time as the optimizer step
visits them: the swapped tensors (fp32 weights and each optimizer state the shard names) read straight from the
checkpoint's swap files by position in the shard (not by id), the rest from the shard, the step counts and
hyperparameters from it, then the bit16 partition (in memory or on NVMe) from the fp32 weights. Before anything is
loaded, :func:`check_nvme_layout` refuses, on every rank, what cannot be loaded exactly: a checkpoint saved with the
optimizer states on NVMe loaded without them there or the other way round, one saved by another number of processes,
and a missing or truncated swap file.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightspeed.core.common.distributed import is_distributed, raise_on_every_rank
from lightspeed.core.errors import CheckpointError
from lightspeed.core.reliability.reshard import saved_world_size

__all__ = ["check_nvme_layout", "install_nvme_checkpoints", "saved_with_nvme_optimizer"]

#: DeepSpeed's folder of copied swap files inside a checkpoint's tag directory
OFFLOADED_FOLDER = "offloaded_tensors"


def swaps_optimizer_states(engine: Any) -> bool:
    """Whether ``engine`` keeps (some of) its optimizer states in NVMe swap files."""
    return bool(getattr(getattr(engine, "optimizer", None), "swap_optimizer", False))


def _parameters_on_nvme(engine: Any) -> bool:
    """Whether ``engine`` keeps its ZeRO-3 parameter partitions in NVMe swap files."""
    return bool(getattr(getattr(engine, "optimizer", None), "params_in_nvme_and_cpu", False))


def _tag(load_dir: Path, tag: str | None) -> str | None:
    """``tag``, or the one the checkpoint's ``latest`` file names (None: neither, DeepSpeed then loads nothing)."""
    if tag is not None:
        return str(tag)
    latest = load_dir / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def saved_with_nvme_optimizer(load_dir: str | os.PathLike[str], tag: str | None) -> bool | None:
    """Whether the checkpoint was saved with its optimizer states on NVMe (its tag directory holds DeepSpeed's copies
    of the swap files); None where there is no tag directory to tell."""
    resolved = _tag(Path(load_dir), tag)
    tag_dir = Path(load_dir) / resolved if resolved is not None else None
    if tag_dir is None or not tag_dir.is_dir():
        return None
    return (tag_dir / OFFLOADED_FOLDER).is_dir()


def check_nvme_layout(engine: Any, load_dir: str | os.PathLike[str], tag: str | None, world_size: int) -> None:
    """Refuse (:class:`CheckpointError`, from every rank alike: each reads the same files) a checkpoint that ``engine``
    cannot resume exactly because of where the optimizer states were and are: saved with them on NVMe and loaded
    without, or the other way round; saved by another number of processes where the optimizer states or the
    parameters are on NVMe (an NVMe save's swap files are each rank's own partition, and DeepSpeed's universal load
    fails on partitions on NVMe)."""
    on_nvme = swaps_optimizer_states(engine)
    saved = saved_with_nvme_optimizer(load_dir, tag)
    where = f"Resuming from {str(load_dir)!r}"
    if saved is None:
        return
    if saved and not on_nvme:
        raise CheckpointError(
            f"{where}: the checkpoint was saved with the optimizer states on NVMe (zero3_nvme), and this run keeps "
            "them elsewhere, where DeepSpeed would read the empty placeholders the NVMe save left in the ZeRO shards. "
            "Resume with the optimizer states on NVMe as the run that saved it did, or export its weights "
            "(`lightspeed export`) and start a new run from them."
        )
    if on_nvme and not saved:
        raise CheckpointError(
            f"{where}: this run keeps the optimizer states on NVMe (zero3_nvme), and the checkpoint was saved with "
            "them in memory or on the CPU, so it has no swap files to resume them from. Resume with the offload it "
            "was saved with, or export its weights (`lightspeed export`) and start a new run from them."
        )
    written_by = saved_world_size(load_dir)
    if written_by is not None and written_by != world_size and (on_nvme or _parameters_on_nvme(engine)):
        raise CheckpointError(
            f"{where}: the checkpoint was written by {written_by} processes and this run has {world_size}, with its "
            "optimizer states or parameters on NVMe, where DeepSpeed cannot load a resharded checkpoint (and an NVMe "
            f"save's swap files hold each rank's own partition). Resume on {written_by} processes, or export its "
            "weights (`lightspeed export`) and start a new run from them."
        )


@dataclass
class _Shard:
    """This rank's ZeRO-3 shard of a checkpoint, as its sub-groups are restored from it."""

    flat_groups: list[torch.Tensor]  # the fp32 partitions; empty where the sub-group was swapped
    state: dict[int, dict[str, Any]]  # the inner optimizer's state, by its position in the param groups
    param_groups: list[dict[str, Any]]
    optimizer_level: dict[str, Any]  # loss scaler, dynamic loss scale, overflow

    @classmethod
    def of(cls, saved: dict[str, Any]) -> _Shard:
        """From the ZeRO-3 optimizer's saved state dict (what its ``load_state_dict`` is given)."""
        from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, LOSS_SCALER, OPTIMIZER_STATE_DICT

        inner = saved[OPTIMIZER_STATE_DICT]
        return cls(
            flat_groups=list(saved[FP32_FLAT_GROUPS]),
            state=inner["state"],
            param_groups=inner["param_groups"],
            optimizer_level={key: saved[key] for key in (LOSS_SCALER, "dynamic_loss_scale", "overflow")},
        )


def _swap_copies(engine: Any, directory: Path, tag: str) -> Path:
    """Where a checkpoint holds this rank's copies of its swap files (DeepSpeed's layout: the node's local rank under
    node-local storage, else the global one)."""
    rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
    return directory / tag / OFFLOADED_FOLDER / f"rank{rank:02d}"


def _swap_files(engine: Any, load_dir: Path, tag: str) -> Path:
    """This rank's copies of its swap files in an NVMe save, checked against this rank's shard: every file the
    shard's swapped sub-groups need is there, not shorter than the sub-group (a :class:`CheckpointError` names what
    is wrong)."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

    path = Path(engine._get_zero_ckpt_name(str(load_dir), tag))
    if not path.is_file():
        raise CheckpointError(f"Resuming from {str(load_dir)!r}: {path} is missing (this rank's ZeRO shard).")
    shard = _Shard.of(torch.load(path, map_location="cpu", weights_only=False)[OPTIMIZER_STATE_DICT])
    files = _swap_copies(engine, load_dir, tag)
    optimizer = engine.optimizer
    _check_sub_groups(optimizer, shard, path)
    position = _position_of_partitions(optimizer)
    swapper = optimizer.optimizer_swapper
    for index, partition in enumerate(optimizer.fp32_partitioned_groups_flat):
        if not optimizer._swappable_optimizer_subgroup(index):
            continue
        numel = int(optimizer.fp16_partitioned_groups_flat_numel[index])
        expected = swapper._io_aligned_numel(numel) * swapper.swap_element_size
        saved_state = shard.state.get(position[id(partition)], {})
        for source in _sources(shard.flat_groups[index], saved_state, files).values():
            size = source.stat().st_size if source.is_file() else None
            if size is None or size < expected:  # a swap folder used before may have left a file longer
                found = "is missing" if size is None else f"has {size} bytes"
                raise CheckpointError(
                    f"{source} {found}: it holds this rank's part of sub-group {index} ({expected} bytes), which the "
                    "checkpoint saved on NVMe. Copy the checkpoint again, whole, or resume from an earlier one."
                )
    return files


def _check_sub_groups(optimizer: Any, shard: _Shard, what: str | Path) -> None:
    """The shard's sub-groups are this engine's: as many, each in memory as large."""
    partitions = optimizer.fp32_partitioned_groups_flat
    if len(shard.flat_groups) != len(partitions):
        raise CheckpointError(
            f"{what} holds {len(shard.flat_groups)} optimizer sub-groups, this engine has {len(partitions)}: it was "
            "saved from another model or another ZeRO configuration (sub_group_size)."
        )
    for index, (partition, flat) in enumerate(zip(partitions, shard.flat_groups, strict=True)):
        if not optimizer._swappable_optimizer_subgroup(index) and flat.numel() != partition.numel():
            raise CheckpointError(
                f"{what}: sub-group {index} has {flat.numel()} elements, this engine's {partition.numel()}: it was "
                "saved from another model or another ZeRO configuration (sub_group_size)."
            )


def _is_placeholder(value: Any) -> bool:
    """A saved optimizer state the swapper had on NVMe: an empty tensor carrying its swap id."""
    return torch.is_tensor(value) and hasattr(value, "ds_id")


def _sources(flat: torch.Tensor, saved_state: dict[str, Any], files: Path) -> dict[str | None, Path]:
    """The checkpoint's swap file of a swapped sub-group's fp32 weights (key None) and of each optimizer state it
    saved there, named by the ids they had when saved."""
    sources: dict[str | None, Path] = {None: files / f"{flat.ds_id}.tensor.swp"}  # type: ignore[attr-defined]
    for key, value in saved_state.items():
        if _is_placeholder(value):
            sources[key] = files / f"{value.ds_id}.tensor.swp"
    return sources


def _position_of_partitions(optimizer: Any) -> dict[int, int]:
    """Each fp32 partition's position in the inner optimizer's state dict, as DeepSpeed saves it (the partitions
    are put into the inner param groups only while it saves)."""
    optimizer._set_fp32_optimizer_param_groups()
    try:
        ordered = [param for group in optimizer.optimizer.param_groups for param in group["params"]]
    finally:
        optimizer._clear_fp32_optimizer_param_groups()
    return {id(param): position for position, param in enumerate(ordered)}


def _on(partition: torch.Tensor, value: Any) -> Any:
    """A saved state value on the partition's device (swapped placeholders stay as they are: they are read into)."""
    if not torch.is_tensor(value) or _is_placeholder(value) or value.device == partition.device:
        return value
    return value.to(partition.device)


def _swap_in_from(optimizer: Any, index: int, sources: dict[str | None, Path], saved_state: dict[str, Any]) -> None:
    """Swap sub-group ``index`` in from the checkpoint's files ``sources``: its fp32 weights and the optimizer states
    saved there, into the saved placeholders, which become its states (named as the swapper names this engine's, so
    that its swap-out writes them where its next step reads them)."""
    partition = optimizer.fp32_partitioned_groups_flat[index]
    info = optimizer.optimizer_swapper.swap_params_info[partition.ds_id]
    info.tensors, info.has_state_tensors = info.tensors[:1], False  # the fp32 weights only, then the saved states:
    placeholders = [(key, value) for key, value in saved_state.items() if key in sources]
    for key, value in placeholders:
        value.ds_id = f"{key}-{partition.ds_id}"  # the swapper's name for state `key` of this partition
    if placeholders:
        info.add_state_tensors([value for _, value in placeholders])
    keys: list[str | None] = [None, *(key for key, _ in placeholders)]  # the order of info.tensors
    own_paths = [context.swap_path for context in info.tensors]
    for context, source in zip(info.tensors, keys, strict=True):
        context.swap_path = str(sources[source])
    try:
        optimizer._prepare_sub_group(index, set())
    finally:
        for context, path in zip(info.tensors, own_paths, strict=True):
            context.swap_path = path


def _restore_sub_groups(optimizer: Any, shard: _Shard, with_states: bool, files: Path | None) -> None:
    """Every sub-group's fp32 weights (and with ``with_states`` its optimizer states) from ``shard`` and, where it was
    swapped, from the checkpoint's swap files in ``files``; then its bit16 partition from the fp32 weights. One
    sub-group in memory at a time, as DeepSpeed's step goes. Without ``with_states`` the optimizer starts afresh."""
    _check_sub_groups(optimizer, shard, "this rank's ZeRO shard")
    inner = optimizer.optimizer
    if with_states:
        for key, value in shard.optimizer_level.items():
            setattr(optimizer, key, value)
        for group, saved in zip(inner.param_groups, shard.param_groups, strict=True):
            group.update({key: value for key, value in saved.items() if key != "params"})
    position = _position_of_partitions(optimizer)
    timer_names: set[str] = set()
    for index, partition in enumerate(optimizer.fp32_partitioned_groups_flat):
        saved_state = shard.state.get(position[id(partition)], {}) if with_states else {}
        inner.state.pop(partition, None)
        if optimizer._swappable_optimizer_subgroup(index):
            assert files is not None  # checked by check_nvme_layout: the optimizer's states were saved on NVMe
            sources = _sources(shard.flat_groups[index], saved_state, files)
            _swap_in_from(optimizer, index, sources, saved_state)
        else:
            optimizer._prepare_sub_group(index, timer_names)
            partition.data.copy_(shard.flat_groups[index])
        if saved_state:
            inner.state[partition] = {key: _on(partition, value) for key, value in saved_state.items()}
        optimizer._reassign_or_swap_out_partitioned_parameters(index)
        optimizer._release_sub_group(index, timer_names)


@contextmanager
def _instead(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.<name>`` is ``value`` within the block (an instance attribute), as before afterwards."""
    own = owner.__dict__.get(name, _ABSENT)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


_ABSENT = object()


def install_nvme_checkpoints(engine: Any) -> None:
    """Make ``engine.load_checkpoint`` check where the checkpoint's optimizer states were (:func:`check_nvme_layout`)
    and restore an engine with its optimizer states or parameters on NVMe exactly, and its ``save_checkpoint`` save
    only this engine's swap files (see the module's docstring). A load without optimizer states
    (``load_optimizer_states=False``, ``load_module_only=True``) restores the weights and starts the optimizer
    afresh. An engine without an optimizer (nothing to resume) is left as it is."""
    if getattr(engine, "optimizer", None) is None:
        return
    _save_own_swap_files(engine)
    _load_exactly(engine)


def _save_own_swap_files(engine: Any) -> None:
    """``engine.save_checkpoint`` copies this engine's swap files (its optimizer swapper's, gradients left out) into
    ``<tag>/offloaded_tensors/rank<NN>``, where DeepSpeed copied the whole swap folder (every earlier engine's too)."""
    if not swaps_optimizer_states(engine):
        return
    save = engine.save_checkpoint

    def save_checkpoint(save_dir: str | os.PathLike[str], tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        resolved = str(tag) if tag is not None else f"global_step{engine.global_steps}"  # DeepSpeed's default
        with _instead(engine, "zero_nvme_offload_optimizer", lambda: False):
            saved = save(save_dir, resolved, *args, **kwargs)
        target = _swap_copies(engine, Path(save_dir), resolved)
        target.mkdir(parents=True)
        swapper = engine.optimizer.optimizer_swapper
        for info in swapper.swap_params_info.values():
            for path in info.get_swap_paths():
                shutil.copyfile(path, target / Path(path).name)
        return saved

    engine.save_checkpoint = save_checkpoint


def _load_exactly(engine: Any) -> None:
    """``engine.load_checkpoint`` with the checks and, with anything on NVMe, lightspeed's restore."""
    load = engine.load_checkpoint

    def load_checkpoint(
        load_dir: str | os.PathLike[str],
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> Any:
        directory = Path(load_dir)
        resolved = _tag(directory, tag)
        world_size = torch.distributed.get_world_size() if is_distributed() else 1
        error: CheckpointError | None = None
        files = None
        try:
            if resolved is not None:
                check_nvme_layout(engine, directory, resolved, world_size)
                if swaps_optimizer_states(engine):
                    files = _swap_files(engine, directory, resolved)
        except CheckpointError as err:
            error = err
        raise_on_every_rank(error, f"Resuming from {str(directory)!r}", error_type=CheckpointError)
        if resolved is None or not (swaps_optimizer_states(engine) or _parameters_on_nvme(engine)):
            arguments = (load_module_strict, load_optimizer_states, load_lr_scheduler_states, load_module_only)
            return load(load_dir, tag, *arguments, custom_load_fn=custom_load_fn)
        optimizer = engine.optimizer
        with_states = load_optimizer_states and not load_module_only

        def rigid_load(state_dict: dict[str, Any], load_optimizer_states: bool = True) -> None:
            _restore_sub_groups(optimizer, _Shard.of(state_dict), with_states, files)

        # DeepSpeed reads every shard and hands this rank's to _rigid_load_state_dict (with the optimizer states on
        # NVMe it would skip them and copy the swap folder instead): the shards always, the states as asked
        with (
            _instead(optimizer, "_rigid_load_state_dict", rigid_load),
            _instead(engine, "zero_nvme_offload_optimizer", lambda: False),
        ):
            return load(
                load_dir,
                tag,
                load_module_strict,
                True,
                load_lr_scheduler_states and not load_module_only,
                False,
                custom_load_fn=custom_load_fn,
            )

    engine.load_checkpoint = load_checkpoint
