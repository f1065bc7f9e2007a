"""What a model built straight into ZeRO-3 partitions needs while it is being built (inside DeepSpeed's ``zero.Init``:
Lightning's ``configure_model``, Fabric's ``init_module()``):

* transformers knows the ZeRO-3 config, so ``from_pretrained`` loads into partitions
  (:mod:`lightspeed.core.zero.hf_link`);
* a deep copy of a partitioned parameter is a partitioned parameter holding the same values. ``zero.Init`` partitions
  the parameters a module's ``__init__`` creates, but ``copy.deepcopy`` runs no ``__init__``: a copied module
  (``nn.TransformerEncoder`` clones its layer, an EMA copy of a model) would keep the empty placeholder tensors of its
  source's parameters, values lost and unknown to DeepSpeed, and the first forward would fail deep inside DeepSpeed.
  While the block runs, copying such a parameter gathers it, clones the full tensor and partitions the clone at once;
* an initialisation of a parameter that is already partitioned applies to the whole parameter. A module's
  ``__init__`` often initialises its children's parameters after the children were built, and so partitioned
  (``nn.MultiheadAttention`` zeroes ``out_proj.bias``; nanoGPT's ``self.apply(self._init_weights)``): on the empty
  placeholder that is a silent no-op, and the model would start from other weights than in one process. While the
  block runs, the ``torch.nn.init`` functions and the in-place fills those use (``fill_``, ``zero_``, ``normal_``,
  ...) called on a partitioned parameter gather it, apply to the full tensor on every rank and keep rank 0's result,
  as one process would have it.

Every rank builds the same model in the same order, so the gathers are collectives all ranks reach.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from lightspeed.core.zero.hf_link import transformers_zero3

__all__ = ["building_into_partitions", "partitioned_parameters_kept_whole"]

#: ``torch.nn.init`` functions whose first argument is the tensor they fill
_INIT_FUNCTIONS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
    "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)  # fmt: skip
#: in-place tensor methods that fill or rescale a tensor (those ``torch.nn.init`` uses, and their kin)
_IN_PLACE_METHODS = (
    "fill_", "zero_", "uniform_", "normal_", "copy_", "mul_", "add_", "sub_", "div_", "clamp_", "exponential_",
    "bernoulli_", "random_", "log_normal_", "cauchy_", "geometric_",
)  # fmt: skip
_depth = 0
_undo: list[tuple[Any, str, Any]] = []


def _active_zero_init() -> Any:
    """DeepSpeed's outermost ``zero.Init`` context while one is entered, else None."""
    from deepspeed.runtime.zero import partition_parameters

    return partition_parameters.top_level_context


def _is_partitioned(tensor: Any) -> bool:
    """Whether ``tensor`` is a ZeRO-3 parameter whose values are away in partitions (its data an empty placeholder)."""
    if not hasattr(tensor, "ds_id"):
        return False
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return bool(tensor.ds_status == ZeroParamStatus.NOT_AVAILABLE)


def _deepcopy_keeping_partition(plain: Any) -> Any:
    """``Parameter.__deepcopy__`` that gives a ZeRO-3 parameter's copy its full values and its own partition."""

    def deepcopy(param: torch.nn.Parameter, memo: dict[int, Any]) -> torch.nn.Parameter:
        init = _active_zero_init()
        if id(param) in memo or init is None or not hasattr(param, "ds_id"):
            return plain(param, memo)
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            copy = type(param)(param.data.clone(memory_format=torch.preserve_format), param.requires_grad)
        memo[id(param)] = copy
        init._convert_to_zero_parameters([copy])  # to the Init's device, broadcast from rank 0, partitioned
        return copy

    return deepcopy


def _applied_to_whole(plain: Any) -> Any:
    """``plain`` (an initialisation taking the tensor first) that, on a partitioned parameter, gathers it, applies to
    the full tensor on every rank and partitions rank 0's result again."""

    def apply(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_partitioned(tensor):
            return plain(tensor, *args, **kwargs)
        import deepspeed

        with deepspeed.zero.GatheredParameters([tensor], modifier_rank=0):
            plain(tensor, *args, **kwargs)
        return tensor

    return apply


def _patch(owner: Any, name: str, wrap: Any) -> None:
    _undo.append((owner, name, owner.__dict__.get(name)))
    setattr(owner, name, wrap(getattr(owner, name)))


@contextlib.contextmanager
def partitioned_parameters_kept_whole() -> Iterator[None]:
    """Within the block, deep copies of ZeRO-3 partitioned parameters made inside ``zero.Init`` are partitioned
    parameters with the source's values, and initialisations of partitioned parameters apply to the whole parameter
    (re-entrant; tensors that are not partitioned parameters are handled as always)."""
    global _depth
    if _depth == 0:
        _patch(torch.nn.Parameter, "__deepcopy__", _deepcopy_keeping_partition)
        for name in _INIT_FUNCTIONS:
            _patch(torch.nn.init, name, _applied_to_whole)
        for name in _IN_PLACE_METHODS:
            _patch(torch.Tensor, name, _applied_to_whole)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            while _undo:
                owner, name, original = _undo.pop()
                if original is None:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)


@contextlib.contextmanager
def building_into_partitions(config: dict[str, Any], enabled: bool) -> Iterator[None]:
    """Wrap the block that builds a model inside ``zero.Init`` under the DeepSpeed ``config`` (``enabled``: the
    config is ZeRO-3; otherwise a no-op): transformers is told of the config, deep copies keep their partition and
    initialisations of partitioned parameters apply to the whole parameter."""
    if not enabled:
        yield
        return
    with transformers_zero3(config), partitioned_parameters_kept_whole():
        yield
