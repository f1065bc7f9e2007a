"""A fingerprint of a model's frozen parameters, saved with a checkpoint that leaves them out.

A checkpoint saved with ``exclude_frozen_parameters`` (the default for PEFT models) holds the trainable weights only;
on resume the frozen ones keep the values the model was built with (the pretrained files). Built any other way (other
files, another seed, a model changed in between) the run would resume silently wrong, so the save records, per frozen
parameter, the float64 sum and sum of squares of its full value, and loading compares them. Under ZeRO-3 each rank
sums its own partition (no parameter is gathered; partitions kept on NVMe are gathered one at a time) and one
all-reduce adds them up.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from lightspeed.core.common.distributed import is_distributed
from lightspeed.core.errors import CheckpointError

__all__ = ["FINGERPRINT_KEY", "check_frozen_fingerprint", "frozen_fingerprint"]

#: the client-state key the fingerprint is saved under
FINGERPRINT_KEY = "lightspeed_frozen_fingerprint"
#: relative difference tolerated between sums added up in another order (another world size partitions otherwise)
_TOLERANCE = 1e-9


def _stats(values: torch.Tensor) -> torch.Tensor:
    flat = values.detach().reshape(-1).to("cpu", torch.float64)
    return torch.stack([flat.sum(), flat.square().sum()])


def _partition_stats(param: Any, rank: int) -> torch.Tensor:
    """This rank's share of ``param``'s sums: the valid elements of its partition (the padding is left out)."""
    from deepspeed.runtime.zero.partition_parameters import OffloadDeviceEnum

    partition = param.ds_tensor
    if getattr(partition, "final_location", None) == OffloadDeviceEnum.nvme:
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            return _stats(param) if rank == 0 else torch.zeros(2, dtype=torch.float64)
    size = partition.ds_numel
    group_rank = dist.get_rank(group=param.ds_process_group) if is_distributed() else 0
    valid = max(0, min(size, param.ds_numel - group_rank * size))
    return _stats(partition.narrow(0, 0, valid))


def frozen_fingerprint(module: torch.nn.Module) -> dict[str, list[float]]:
    """Per frozen parameter of ``module`` (by name): ``[sum, sum of squares]`` of its full value, in float64. A
    collective where the parameters are ZeRO-3 partitioned: every rank calls it and gets the same result."""
    frozen = [(name, param) for name, param in module.named_parameters() if not param.requires_grad]
    if not frozen:
        return {}
    rank = dist.get_rank() if is_distributed() else 0
    stats = torch.zeros(len(frozen), 2, dtype=torch.float64)
    for index, (_, param) in enumerate(frozen):
        if hasattr(param, "ds_id"):
            stats[index] = _partition_stats(param, rank)
        elif rank == 0:  # whole on every rank: counted once
            stats[index] = _stats(param)
    if is_distributed():
        dist.all_reduce(stats)
    return {name: stats[index].tolist() for index, (name, _) in enumerate(frozen)}


def check_frozen_fingerprint(module: torch.nn.Module, saved: dict[str, list[float]], checkpoint: str) -> None:
    """Raise :class:`CheckpointError` (on every rank: the fingerprint is computed collectively) when ``module``'s
    frozen parameters are not those the checkpoint was saved with. A collective under ZeRO-3."""
    now = frozen_fingerprint(module)
    differ = sorted(
        name
        for name, (total, squares) in saved.items()
        if name in now
        and not (
            math.isclose(now[name][0], total, rel_tol=_TOLERANCE, abs_tol=_TOLERANCE * math.sqrt(squares))
            and math.isclose(now[name][1], squares, rel_tol=_TOLERANCE, abs_tol=1e-30)
        )
    )
    if differ:
        shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
        raise CheckpointError(
            f"Checkpoint {checkpoint!r} left the frozen parameters out, and {len(differ)} of this model's frozen "
            f"parameters differ from those it was saved with ({shown}): resuming would continue from other weights. "
            "Build the model as the run that saved it did (the same pretrained files), or save with "
            "exclude_frozen_parameters=False."
        )
