"""transformers' ``from_pretrained`` under ZeRO-3, reading one checkpoint shard at a time on rank 0.

transformers (5.x) loads a checkpoint into a ZeRO-3 model by reading every shard into one state dict on rank 0 (the
other ranks read meta tensors of the same shapes), then, module by module, gathering the partitioned parameters,
copying rank 0's tensors in and partitioning them again. So rank 0 holds the whole model in host memory while it
loads (8.4 GB for a 2B-parameter model in fp32), however little ZeRO-3 needs afterwards. Within
:func:`one_shard_at_a_time` transformers' reads of the shards for that load give every rank the shapes only, and its
ZeRO-3 loader runs once per shard with that shard's tensors read on rank 0: rank 0 holds one shard at a time, and the
weights loaded are the same.

Checkpoints whose tensors transformers converts while loading (``weight_mapping`` beyond renamed keys: experts fused
from several tensors, possibly of several shards) are read whole on rank 0 as before, and so is any load whose reads
do not match the state dict transformers passes on (a transformers that loads differently).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["one_shard_at_a_time"]


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _combines_tensors(load_config: Any) -> bool:
    """Whether transformers converts tensors while loading (other than renaming keys, which it does for every model:
    legacy names such as ``LayerNorm.gamma``); a conversion may take its tensors from several shards."""
    from transformers.core_model_loading import WeightRenaming

    mapping = getattr(load_config, "weight_mapping", None) or []
    return any(not isinstance(transform, WeightRenaming) for transform in mapping)


@contextlib.contextmanager
def one_shard_at_a_time() -> Iterator[None]:
    """Within the block, transformers' ZeRO-3 ``from_pretrained`` holds one shard at a time on rank 0 (see the
    module's docstring); a no-op for a transformers without the two functions this relies on."""
    from transformers import modeling_utils as transformers_loading

    modeling_utils: Any = transformers_loading  # its functions are replaced by ones of other (looser) signatures
    read = getattr(modeling_utils, "load_state_dict", None)
    load_into_zero3 = getattr(modeling_utils, "_load_state_dict_into_zero3_model", None)
    if read is None or load_into_zero3 is None:
        yield
        return
    shards: list[tuple[Any, dict[str, Any], list[str]]] = []  # file, read options, keys: the load under way

    def read_shapes(checkpoint_file: Any, map_location: Any = "cpu", **options: Any) -> dict[str, torch.Tensor]:
        # the ZeRO-3 load's reads pass both options; rank 0 reads to "cpu", the others to "meta"
        if {"weights_only", "disable_mmap"} <= options.keys() and map_location in ("cpu", "meta"):
            shapes = read(checkpoint_file, map_location="meta", **options)
            shards.append((checkpoint_file, options, list(shapes)))
            return shapes
        return read(checkpoint_file, map_location=map_location, **options)

    def load_by_shard(model: Any, state_dict: dict[str, Any], load_config: Any = None) -> Any:
        pending = list(shards)
        shards.clear()
        location = "cpu" if _rank() == 0 else "meta"
        keys = [key for _, _, shard_keys in pending for key in shard_keys]
        if not pending or len(keys) != len(set(keys)) or set(keys) != set(state_dict):
            return load_into_zero3(model, state_dict, load_config)  # not a load this module made (or understands)
        if _combines_tensors(load_config):
            whole: dict[str, Any] = {}
            for file, options, _ in pending:
                whole.update(read(file, map_location=location, **options))
            return load_into_zero3(model, whole, load_config)
        errors: list[str] = []
        missing: set[str] | None = None
        for file, options, _ in pending:
            shard = read(file, map_location=location, **options)
            shard_errors, shard_missing = load_into_zero3(model, shard, load_config)
            del shard
            errors.extend(shard_errors)
            missing = set(shard_missing) if missing is None else missing & set(shard_missing)
        return errors, missing or set()

    modeling_utils.load_state_dict = read_shapes
    modeling_utils._load_state_dict_into_zero3_model = load_by_shard
    try:
        yield
    finally:
        modeling_utils.load_state_dict = read
        modeling_utils._load_state_dict_into_zero3_model = load_into_zero3
