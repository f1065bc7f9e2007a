"""Map every tensor of a DeepSpeed ZeRO checkpoint onto the byte ranges of the rank files that hold it.

What DeepSpeed writes (checked against deepspeed/runtime/zero/stage_1_and_2.py, stage3.py, bf16_optimizer.py and
engine.py):

* Stages 1 and 2 (and DeepSpeed's ``BF16_Optimizer``, ``bf16_zero_pp_rank_*`` files): each rank's optimizer file holds
  ``single_partition_of_fp32_groups``, one slice per parameter group of the group's flat fp32 master buffer;
  concatenated over ranks they give the flat buffer, in which the parameters of ``param_shapes[group]`` follow
  each other, separated by ``param_alignment_paddings``.
* Stage 3: each rank holds ``fp32_flat_groups``, one flat tensor per sub-group; in it every parameter has
  ``ceil(numel / world_size)`` elements, and the parameter is the concatenation over ranks, cut to its size.
  With NVMe optimizer offload the tensor saved is empty: the data sits in the swap file
  ``<tag>/offloaded_tensors/rankNN/<ds_id>.tensor.swp`` that DeepSpeed copies next to the checkpoint, and
  ``ds_id`` is pickled on the empty tensor.
* Frozen parameters are not in the optimizer: ``frozen_param_fragments`` in the model states holds them in the
  training dtype (stage 3: each rank's file holds its padded partition).
* Stage 0 (DeepSpeed ignores optimizer offload there) has no ZeRO optimizer files: the model states' ``module``
  holds the full weights in the training dtype, and that is what is exported. With bf16 training the fp32 master
  copies sit unnamed in the model states' ``optimizer`` entry, so a stage-0 bf16 export holds the bf16 weights
  (upcast when fp32 is requested). Stage 0 also records no frozen/trainable split.
* ``shared_params`` maps a tied name to the name that owns the data; buffers are in ``module`` (``buffer_names``).

Nothing here loads tensor data: the result lists, per tensor, the :class:`FileRegion` pieces to concatenate.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightspeed.core.checkpoint.locate import CheckpointFiles, locate
from lightspeed.core.checkpoint.plan import wrapper_unwrapper
from lightspeed.core.checkpoint.torch_zip import FileRegion, RegionReader, as_int, load_lazy
from lightspeed.core.errors import CheckpointError
from lightspeed.core.peft.layout import ADAPTERS_KEY

__all__ = ["TensorSource", "ZeroCheckpoint", "assemble", "read_zero_checkpoint"]


@dataclass
class TensorSource:
    """One tensor of the model: its name, shape, stored dtype, kind and the file pieces to concatenate."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str  # "param" (fp32 master weights), "frozen", "buffer" or "module" (weights stored in the module)
    pieces: list[FileRegion]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ZeroCheckpoint:
    """The tensors of one checkpoint tag, in the module's ``state_dict`` order."""

    files: CheckpointFiles
    stage: int
    world_size: int
    tensors: list[TensorSource]
    aliases: dict[str, str]  # tied name -> name of the tensor that holds the data
    ds_version: str | None = None
    skipped: list[str] = field(default_factory=list)  # non-tensor state_dict entries (extra state)
    adapters: list[dict[str, Any]] = field(default_factory=list)  # PEFT adapter layouts saved with it (AdapterLayout)


def assemble(source: TensorSource, reader: RegionReader) -> torch.Tensor:
    """Concatenate ``source``'s pieces into a new tensor of ``source.shape`` (one allocation of its size)."""
    out = torch.empty(source.numel, dtype=source.dtype)
    position = 0
    for piece in source.pieces:
        if piece.dtype != source.dtype:
            raise CheckpointError(f"{piece.path}: {source.name} is stored in mixed dtypes")
        reader.read_into(piece, out[position : position + piece.numel])
        position += piece.numel
    if position != source.numel:
        raise CheckpointError(
            f"{source.name}: the checkpoint holds {position} elements, the shape needs {source.numel}"
        )
    return out.view(source.shape)


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in value)


def _steps(obj: Any, reader: RegionReader, found: set[float], depth: int = 0) -> None:
    """Collect the optimizer 'step' counters found anywhere in an optimizer state (ints or 1-element tensors)."""
    if depth > 6:
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "step":
                if isinstance(value, (int, float)):
                    found.add(float(value))
                elif isinstance(value, FileRegion) and value.numel == 1:
                    found.add(float(reader.read(value).item()))
            else:
                _steps(value, reader, found, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _steps(value, reader, found, depth + 1)


def _expected_optim_name(files: CheckpointFiles, rank: int) -> str:
    sample = next(iter(files.optim_files.values())).name
    prefix = sample[: sample.index("zero_pp_rank_")]
    return f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


class _Reader:
    def __init__(self, files: CheckpointFiles) -> None:
        self.files = files
        self.regions = RegionReader()

    # ---------------------------------------------------------------- optimizer files
    def load_optim_states(self) -> tuple[int, int, list[dict[str, Any]]]:
        files = self.files
        first_rank = min(files.optim_files)
        first = self._optim_state(files.optim_files[first_rank])
        count = first.get("partition_count")
        if count is None:
            raise CheckpointError(f"{files.optim_files[first_rank]}: no 'partition_count'; not a ZeRO optimizer file")
        world_size = max(as_int(c) for c in count) if isinstance(count, (list, tuple)) else as_int(count)
        missing = [r for r in range(world_size) if r not in files.optim_files]
        if missing:
            names = ", ".join(_expected_optim_name(files, r) for r in missing)
            raise CheckpointError(
                f"{files.tag_dir} is missing the optimizer file of rank(s) {missing} ({names}); the checkpoint was "
                f"saved by {world_size} ranks and every rank's file is needed"
            )
        extra = sorted(r for r in files.optim_files if r >= world_size)
        if extra:
            raise CheckpointError(
                f"{files.optim_files[extra[0]]} belongs to a run with more ranks: the other files in {files.tag_dir} "
                f"were saved by {world_size} ranks (files from different runs are mixed)"
            )
        states = [first if r == first_rank else self._optim_state(files.optim_files[r]) for r in range(world_size)]
        stage = as_int(first["zero_stage"]) if "zero_stage" in first else 0
        for rank, state in enumerate(states):
            path = files.optim_files[rank]
            other_count = state.get("partition_count")
            other_ws = (
                max(as_int(c) for c in other_count) if isinstance(other_count, (list, tuple)) else as_int(other_count)
            )
            if other_ws != world_size:
                raise CheckpointError(
                    f"{path} was saved by a run with {other_ws} ranks, {files.optim_files[first_rank].name} by one "
                    f"with {world_size}: files from different runs are mixed in {files.tag_dir}"
                )
            other_stage = as_int(state["zero_stage"]) if "zero_stage" in state else 0
            if other_stage != stage:
                raise CheckpointError(
                    f"{path} is a ZeRO stage {other_stage} file, {files.optim_files[first_rank].name} stage {stage}: "
                    f"files from different runs are mixed in {files.tag_dir}"
                )
        steps = []
        for state in states:
            found: set[float] = set()
            _steps(
                {k: v for k, v in state.items() if k not in ("single_partition_of_fp32_groups", "fp32_flat_groups")},
                self.regions,
                found,
            )
            steps.append(found)
        for rank, found in enumerate(steps):
            if found and steps[0] and found != steps[0]:
                raise CheckpointError(
                    f"{files.optim_files[rank]} is at optimizer step {sorted(found)}, "
                    f"{files.optim_files[0].name} at step {sorted(steps[0])}: files from different saves are mixed "
                    f"in {files.tag_dir}"
                )
        return stage, world_size, states

    def _optim_state(self, path: Path) -> dict[str, Any]:
        state = load_lazy(path)
        inner = state.get("optimizer_state_dict") if isinstance(state, dict) else None
        if not isinstance(inner, dict):
            raise CheckpointError(f"{path}: no 'optimizer_state_dict'; not a DeepSpeed optimizer file")
        return inner

    # ---------------------------------------------------------------- model files
    def load_model_states(self, stage: int, world_size: int) -> list[dict[str, Any]]:
        files = self.files
        if stage == 3:
            missing = [r for r in range(world_size) if r not in files.model_files]
            if missing:
                names = ", ".join(f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in missing)
                raise CheckpointError(f"{files.tag_dir} is missing the model states of rank(s) {missing} ({names})")
            paths = [files.model_files[r] for r in range(world_size)]
        else:
            plain = files.tag_dir / "mp_rank_00_model_states.pt"
            if not plain.is_file():
                raise CheckpointError(f"{files.tag_dir} is missing mp_rank_00_model_states.pt")
            paths = [plain]
        states = []
        for path in paths:
            state = load_lazy(path)
            if not isinstance(state, dict) or not isinstance(state.get("module"), dict):
                raise CheckpointError(f"{path}: no 'module' state dict; not a DeepSpeed model states file")
            states.append(state)
        first = states[0]
        for path, state in zip(paths[1:], states[1:], strict=True):
            if _shape_lists(state.get("param_shapes")) != _shape_lists(first.get("param_shapes")):
                raise CheckpointError(
                    f"{path} describes different parameters than {paths[0].name}: files from different runs are "
                    f"mixed in {files.tag_dir}"
                )
            if state.get("global_steps") != first.get("global_steps"):
                raise CheckpointError(
                    f"{path} was saved at step {state.get('global_steps')}, {paths[0].name} at step "
                    f"{first.get('global_steps')}: files from different saves are mixed in {files.tag_dir}"
                )
        if stage == 3 and first.get("dp_world_size") not in (None, world_size):
            raise CheckpointError(
                f"{paths[0]} was saved by {first.get('dp_world_size')} ranks but the optimizer files by {world_size}"
            )
        return states

    # ---------------------------------------------------------------- trainable parameters
    def _flat_groups(self, states: list[dict[str, Any]], key: str, expected: int, unit: str) -> list[list[FileRegion]]:
        """Every rank's list of flat fp32 partitions under ``key``, checked to hold ``expected`` groups."""
        per_rank = []
        for rank, state in enumerate(states):
            groups = state.get(key)
            if not isinstance(groups, (list, tuple)) or not all(isinstance(g, FileRegion) for g in groups):
                raise CheckpointError(f"{self.files.optim_files[rank]}: no fp32 partitions ({key!r})")
            if len(groups) != expected:
                raise CheckpointError(
                    f"{self.files.optim_files[rank]} has {len(groups)} {unit}, the model states {expected}: "
                    f"files from different runs are mixed in {self.files.tag_dir}"
                )
            per_rank.append(list(groups))
        return per_rank

    def partitioned_params(self, states: list[dict[str, Any]], shapes: list[dict[str, Any]]) -> dict[str, TensorSource]:
        """Stage 1/2 (and bf16 stage 0): rank partitions of each group's flat buffer, parameters back to back."""
        world_size = len(states)
        per_rank = self._flat_groups(states, "single_partition_of_fp32_groups", len(shapes), "parameter groups")
        paddings = states[0].get("param_alignment_paddings")
        sources: dict[str, TensorSource] = {}
        align = 2 * world_size
        for g, group_shapes in enumerate(shapes):
            parts = [per_rank[r][g] for r in range(world_size)]
            starts = [0]
            for part in parts:
                starts.append(starts[-1] + part.numel)
            total = starts[-1]
            group_padding = list(paddings[g]) if paddings is not None else [0] * len(group_shapes)
            if len(group_padding) != len(group_shapes):
                raise CheckpointError(f"{self.files.optim_files[0]}: alignment paddings do not match group {g}")
            offset = 0
            for (name, shape), pad in zip(group_shapes.items(), group_padding, strict=False):
                shape = _shape(shape)
                numel = math.prod(shape)
                pieces = []
                for r, part in enumerate(parts):
                    lo, hi = max(offset, starts[r]), min(offset + numel, starts[r + 1])
                    if hi > lo:
                        pieces.append(part.slice(lo - starts[r], hi - lo))
                if sum(p.numel for p in pieces) != numel:
                    raise CheckpointError(
                        f"{self.files.tag_dir}: the fp32 partitions hold {total} elements of group {g} but parameter "
                        f"{name!r} needs elements up to {offset + numel}; a rank file is truncated or from another run"
                    )
                sources[name] = TensorSource(name, shape, parts[0].dtype, "param", pieces)
                offset += numel + int(pad)
            if math.ceil(offset / align) * align != math.ceil(total / align) * align:
                raise CheckpointError(
                    f"{self.files.tag_dir}: group {g} has {total} fp32 elements but its parameters use {offset}; "
                    "the optimizer files do not belong to these model states"
                )
        return sources

    def stage3_params(self, states: list[dict[str, Any]], shapes: list[dict[str, Any]]) -> dict[str, TensorSource]:
        """Stage 3: per sub-group flat partitions, every parameter split evenly over ranks (NVMe: swap files)."""
        world_size = len(states)
        sources: dict[str, TensorSource] = {}
        per_rank = self._flat_groups(states, "fp32_flat_groups", len(shapes), "sub-groups")
        for g, group_shapes in enumerate(shapes):
            partition_sizes = [math.ceil(math.prod(_shape(s)) / world_size) for s in group_shapes.values()]
            length = sum(partition_sizes)
            flats = [self._stage3_flat(rank, per_rank[rank][g], length) for rank in range(world_size)]
            offset = 0
            for (name, shape), size in zip(group_shapes.items(), partition_sizes, strict=False):
                shape = _shape(shape)
                sources[name] = TensorSource(
                    name, shape, flats[0].dtype, "param", _split_pieces(flats, offset, size, math.prod(shape))
                )
                offset += size
        return sources

    def _stage3_flat(self, rank: int, flat: FileRegion, length: int) -> FileRegion:
        if flat.numel == length:
            return flat
        path = self.files.optim_files[rank]
        if flat.numel == 0 and length > 0:
            ds_id = flat.attrs.get("ds_id")
            folder = self.files.offload_dir(rank)
            if ds_id is None or folder is None:
                raise CheckpointError(
                    f"{path}: the fp32 partition of a sub-group is empty, as with NVMe optimizer offload, but "
                    f"{self.files.tag_dir / 'offloaded_tensors' / f'rank{rank:02d}'} with DeepSpeed's swap files is "
                    "missing; copy it back from where the checkpoint was saved"
                )
            swap = folder / f"{ds_id}.tensor.swp"
            if not swap.is_file():
                raise CheckpointError(
                    f"{swap} is missing: it holds rank {rank}'s fp32 weights of an NVMe-offloaded sub-group"
                )
            itemsize = torch.empty((), dtype=flat.dtype).element_size()
            size = swap.stat().st_size
            if size < length * itemsize:
                raise CheckpointError(
                    f"{swap} is truncated: it has {size} bytes, the sub-group needs {length * itemsize}"
                )
            return FileRegion(swap, 0, flat.dtype, length, (length,))
        raise CheckpointError(
            f"{path}: a sub-group holds {flat.numel} fp32 elements but its parameters need {length} per rank; "
            f"the file does not belong to these model states (different run or world size)"
        )

    # ---------------------------------------------------------------- frozen parameters
    def frozen_params(self, stage: int, states: list[dict[str, Any]]) -> dict[str, TensorSource]:
        first = states[0]
        shapes = first.get("frozen_param_shapes") or {}
        sources: dict[str, TensorSource] = {}
        world_size = len(states)
        for name, shape in shapes.items():
            shape = _shape(shape)
            numel = math.prod(shape)
            fragments = []
            for rank, state in enumerate(states):
                fragment = (state.get("frozen_param_fragments") or {}).get(name)
                if not isinstance(fragment, FileRegion):
                    where = self.files.model_files.get(rank, self.files.tag_dir)
                    raise CheckpointError(f"{where}: no data for the frozen parameter {name!r}")
                fragments.append(fragment)
            if stage == 3:
                size = math.ceil(numel / world_size)
                for rank, fragment in enumerate(fragments):
                    if fragment.numel < size:
                        raise CheckpointError(
                            f"{self.files.model_files[rank]}: frozen parameter {name!r} has {fragment.numel} "
                            f"elements on this rank, {size} expected (files from different runs?)"
                        )
                pieces = _split_pieces(fragments, 0, size, numel)
            else:
                if fragments[0].numel != numel:
                    raise CheckpointError(f"{self.files.tag_dir}: frozen parameter {name!r} has the wrong size")
                pieces = [fragments[0]]
            sources[name] = TensorSource(name, shape, fragments[0].dtype, "frozen", pieces)
        return sources


def _shape_lists(value: Any) -> Any:
    if not isinstance(value, (list, tuple)):
        return value
    return [[(k, _shape(v)) for k, v in group.items()] for group in value]


def _split_pieces(parts: list[FileRegion], offset: int, size: int, numel: int) -> list[FileRegion]:
    """Rank r holds elements [r*size, (r+1)*size) of the padded parameter at ``offset`` in its part."""
    pieces = []
    for rank, part in enumerate(parts):
        count = min(size, numel - rank * size)
        if count > 0:
            pieces.append(part.slice(offset, count))
    return pieces


def _identity(region: FileRegion) -> tuple:
    """Where a tensor's data lies in its file: equal for the names of one tensor that torch.save stored once (every
    storage, even an empty ZeRO-3 placeholder, is a zip entry of its own at its own offset)."""
    return (region.path, region.offset, region.numel, region.dtype, region.shape)


def _first_name_per_storage(module: dict[str, Any]) -> dict[tuple, str]:
    """For each stored tensor of the module's state dict, the first key (in state_dict order) that names it."""
    first: dict[tuple, str] = {}
    for name, value in module.items():
        if isinstance(value, FileRegion):
            first.setdefault(_identity(value), name)
    return first


def _check_aliases(
    where: Path, module: dict[str, Any], aliases: dict[str, str], shapes: dict[str, tuple[int, ...]]
) -> None:
    """Every alias names a tensor the checkpoint holds, and where the module states store the alias's own data
    (ZeRO-1/2; ZeRO-3 stores empty placeholders) its shape is the shape of that tensor."""
    for alias, target in aliases.items():
        if target not in shapes:
            raise CheckpointError(
                f"{where}: {alias!r} is tied to {target!r}, but the checkpoint holds no data for either name"
            )
        stored = module.get(alias)
        if isinstance(stored, FileRegion) and stored.numel > 0 and tuple(stored.shape) != tuple(shapes[target]):
            raise CheckpointError(
                f"{where}: {alias!r} is tied to {target!r}, but the checkpoint stores {alias!r} with shape "
                f"{list(stored.shape)} and {target!r} with shape {list(shapes[target])}; a shared tensor has one "
                "shape. The checkpoint was edited or written by another model: export it from the run that wrote it."
            )


def read_zero_checkpoint(
    checkpoint: str | os.PathLike | Sequence[str | os.PathLike], tag: str | None = None
) -> ZeroCheckpoint:
    """Read the structure of a DeepSpeed checkpoint (no tensor data) and validate that its files fit together
    (``checkpoint``: a directory, or every node's directory of a node-local checkpoint)."""
    files = locate(checkpoint, tag)
    reader = _Reader(files)
    try:
        if files.optim_files:
            stage, world_size, optim_states = reader.load_optim_states()
        else:
            stage, world_size, optim_states = 0, 1, []
        model_states = reader.load_model_states(stage, world_size)
        first = model_states[0]
        module: dict[str, Any] = first["module"]
        shapes = first.get("param_shapes")
        trainable: dict[str, TensorSource] = {}
        if optim_states:
            if not isinstance(shapes, (list, tuple)):
                raise CheckpointError(f"{files.model_files.get(0, files.tag_dir)}: no 'param_shapes'")
            if stage == 3:
                trainable = reader.stage3_params(optim_states, list(shapes))
            else:
                trainable = reader.partitioned_params(optim_states, list(shapes))
        frozen = reader.frozen_params(stage, model_states)
        shared = {str(k): str(v) for k, v in (first.get("shared_params") or {}).items()}
        buffer_names = set(first.get("buffer_names") or [])
        tensors: list[TensorSource] = []
        aliases: dict[str, str] = {}
        skipped: list[str] = []
        seen: set[str] = set()
        first_with_storage = _first_name_per_storage(module)
        for name, value in module.items():
            if name in shared and shared[name] != name:
                aliases[name] = shared[name]
                continue
            source = trainable.get(name) or frozen.get(name)
            owner = first_with_storage.get(_identity(value)) if isinstance(value, FileRegion) else None
            if source is None and owner is not None and owner != name:
                # The same tensor under another name that DeepSpeed did not record (torch.save kept one storage for
                # it): a tied weight or buffer stored in the module, or a module registered twice in one parent
                # (``nn.Sequential(block, act, block)``), which DeepSpeed's walk over ``named_children()`` visits once.
                aliases[name] = aliases.get(owner, owner)
                continue
            if source is None and isinstance(value, FileRegion):
                if name in buffer_names or stage < 3 and value.numel == math.prod(value.shape):
                    # stage >= 1: a parameter the optimizer does not own was frozen (stage 1 files list no
                    # frozen_param_shapes; DeepSpeed's own converter drops these); stage 0 records nothing
                    kind = "buffer" if name in buffer_names else "frozen" if stage >= 1 else "module"
                    source = TensorSource(name, value.shape, value.dtype, kind, [value])
                else:
                    raise CheckpointError(
                        f"{files.tag_dir}: the checkpoint holds no data for {name!r} (it is neither optimised, frozen "
                        "nor a buffer)"
                    )
            if source is None:
                skipped.append(name)
                continue
            tensors.append(source)
            seen.add(name)
        for name, source in {**trainable, **frozen}.items():
            if name not in seen:
                tensors.append(source)
        _check_aliases(files.tag_dir, module, aliases, {t.name: t.shape for t in tensors})
        unwrap = wrapper_unwrapper([t.name for t in tensors] + list(aliases))
        for source in tensors:
            source.name = unwrap(source.name)
        aliases = {unwrap(a): unwrap(t) for a, t in aliases.items()}
        skipped = [unwrap(name) for name in skipped]
        ds_version = first.get("ds_version")
        adapters = list(first.get(ADAPTERS_KEY) or [])
        return ZeroCheckpoint(
            files, stage, world_size, tensors, aliases, str(ds_version) if ds_version else None, skipped, adapters
        )
    finally:
        reader.regions.close()
