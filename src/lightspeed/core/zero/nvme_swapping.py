"""ZeRO-3 NVMe offload sized from the model, so that it needs less host memory than keeping everything in RAM.

DeepSpeed's defaults for NVMe offload are constants that suit no particular model, and on a model of a few hundred
million parameters they make NVMe offload need *more* memory than plain ZeRO-3 (measured: 4.8 GB against 3.0 GB per
rank for a 117M-parameter Llama on 2 CPU ranks):

* ``offload_param.max_in_cpu`` (1e9 elements) keeps up to a billion parameter elements in RAM besides their NVMe copy;
* ``offload_param.buffer_size`` x ``buffer_count`` (1e8 x 5 elements, 2 GB in fp32) is allocated and page-locked when
  ``zero.Init`` starts, before any parameter exists; it only has to hold the largest parameter partition;
* ``stage3_max_reuse_distance`` (1e9) keeps every parameter gathered through the forward pass, each holding a swap
  buffer, so the buffer count would have to match the parameter count;
* ``sub_group_size`` (1e9 elements: the whole partition) sizes the optimizer swapper's buffers (4 of them for Adam)
  and, with the parameters on NVMe too, the partitioned swap buffer (the world size times the largest sub-group).

What lightspeed sets where the config leaves it out (a value the user wrote is kept, and checked where DeepSpeed
would only assert later): ``max_in_cpu`` 0, ``stage3_max_reuse_distance`` 0, ``buffer_size`` the largest parameter
partition (or the largest optimizer sub-group, when the user's ``sub_group_size`` makes one larger: DeepSpeed
initialises the optimizer states through these buffers), ``buffer_count`` the most parameters one module's forward
holds at once plus one to prefetch into, and, with the optimizer on NVMe, ``sub_group_size`` 1 (one parameter per
sub-group). Weights are unchanged: the same steps in another memory layout (checked bit for bit against ZeRO-3 with
the same optimizer).

A model built inside ``zero.Init`` (``configure_model``, ``fabric.init_module``) meets the parameter swapper before
its sizes are known: :func:`lightspeed_parameter_swapper` makes ``zero.Init`` start with the smallest buffers and grow
them to each new largest partition while the model is built (nothing else holds a buffer then), and
:func:`size_nvme_swapping` gives it its final size before the engine is built. Its swappers also take each parameter
once when DeepSpeed's prefetch asks for one twice (see ``ParameterSwapper``).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from lightspeed.core.errors import DeepSpeedConfigError

__all__ = [
    "largest_partition",
    "lightspeed_parameter_swapper",
    "parameters_held_at_once",
    "remove_swap_files",
    "size_nvme_swapping",
]

#: parameter swappers lightspeed made in this process (each after the first swaps into a folder of its own)
_swappers_made = itertools.count()


def _offload_device(zero: dict[str, Any], section: str) -> str:
    offload = zero.get(section)
    return str(offload.get("device", "none")) if isinstance(offload, dict) else "none"


def _partition_numel(parameter: torch.nn.Parameter, world_size: int) -> int:
    """Elements of this rank's partition of ``parameter`` (DeepSpeed's, once partitioned)."""
    ds_tensor = getattr(parameter, "ds_tensor", None)
    if ds_tensor is not None and hasattr(ds_tensor, "ds_numel"):
        return int(ds_tensor.ds_numel)
    return math.ceil(getattr(parameter, "ds_numel", parameter.numel()) / world_size)


def largest_partition(model: torch.nn.Module, world_size: int) -> int:
    """The most elements one parameter's partition holds on a rank (1 for a model without parameters)."""
    return max((_partition_numel(p, world_size) for p in model.parameters()), default=1) or 1


def parameters_held_at_once(model: torch.nn.Module) -> int:
    """The most parameters ZeRO-3 holds gathered at once in a forward pass with no reuse: a module's own parameters
    stay gathered while its children run, so the largest sum along a path from the model to a module; a ZeRO-3 leaf
    module (``deepspeed.utils.set_z3_leaf_modules``) gathers all of its parameters on entry."""

    def held(module: torch.nn.Module) -> int:
        if getattr(module, "_z3_leaf", False):
            return sum(1 for _ in module.parameters())
        own = sum(1 for _ in module.parameters(recurse=False))
        return own + max((held(child) for child in module.children()), default=0)

    return max(held(model), 1)


def _sized(section: dict[str, Any], key: str, value: int, minimum: int, why: str) -> None:
    """``section[key] = value`` unless the user set it; a user's value below ``minimum`` is refused with ``why``."""
    if key not in section or section[key] == "auto":
        section[key] = value
    elif isinstance(section[key], int) and section[key] < minimum:
        raise DeepSpeedConfigError(why.format(value=section[key], minimum=minimum))


def size_nvme_swapping(config: dict[str, Any], model: torch.nn.Module, world_size: int) -> None:
    """Fill in ``config``'s NVMe swap sizes for ``model`` (ZeRO-3 only; in place, see the module's docstring) and give
    a parameter swapper made by :func:`lightspeed_parameter_swapper` those sizes."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict) or zero.get("stage") != 3:
        return
    parameters_on_nvme = _offload_device(zero, "offload_param") == "nvme"
    if _offload_device(zero, "offload_optimizer") == "nvme":
        zero.setdefault("sub_group_size", 1)
    if not parameters_on_nvme:
        return
    offload = zero["offload_param"]
    offload.setdefault("max_in_cpu", 0)
    zero.setdefault("stage3_max_reuse_distance", 0)
    largest = largest_partition(model, world_size)
    sub_group = zero.get("sub_group_size")
    needed = largest
    if isinstance(sub_group, int) and sub_group > 1 and _offload_device(zero, "offload_optimizer") == "nvme":
        total = sum(_partition_numel(p, world_size) for p in model.parameters())
        needed = max(largest, min(sub_group + largest - 1, total))  # a sub-group closes once it reaches sub_group
    _sized(
        offload,
        "buffer_size",
        needed,
        needed,
        "offload_param.buffer_size={value} cannot hold the model's largest parameter partition (or optimizer "
        "sub-group) of {minimum} elements: DeepSpeed would fail while building the model. Leave buffer_size out "
        "(lightspeed sizes it from the model) or set it to at least {minimum}.",
    )
    count = parameters_held_at_once(model) + 1
    _sized(offload, "buffer_count", count, 1, "offload_param.buffer_count must be at least {minimum}, got {value}.")
    swappers = {id(s): s for p in model.parameters() if isinstance(s := getattr(p, "nvme_swapper", None), _Growing)}
    for swapper in swappers.values():
        swapper.resize(int(offload["buffer_size"]), int(offload["buffer_count"]))


class _Growing:
    """What the growing swapper of :func:`lightspeed_parameter_swapper` is an instance of (DeepSpeed's class is
    imported lazily)."""

    def resize(self, elements: int, count: int) -> None:  # pragma: no cover - replaced by the real class
        raise NotImplementedError


def _swapper_classes() -> tuple[type, type]:
    """lightspeed's parameter swappers: ``(each parameter swapped in once, that one growing its buffers)``."""
    from deepspeed.runtime.swap_tensor import partitioned_param_swapper

    base: Any = partitioned_param_swapper.AsyncPartitionedParameterSwapper  # untyped: its attributes are Any here

    class ParameterSwapper(base):
        """DeepSpeed's parameter swapper, asked for each parameter once per swap-in, in a folder of its own.

        DeepSpeed's NVMe prefetch lists the parameters of the modules its trace expects next, and a parameter the
        trace uses twice in that stretch (a small model, a forward that skips layers) came twice, which failed an
        assertion ("param N already assigned swap buffer id M"). And every swapper empties its folder,
        ``<nvme_path>/zero_stage_3/<dtype>params/rank<R>``, when it is made: a second model built in the process (a
        GAN's discriminator, a teacher, a Fabric loop's second model) deleted the first one's parameters, whose next
        forward then failed reading them. The first swapper of the process keeps DeepSpeed's folder, each later one
        has ``<nvme_path>/model<N>/...``, and a parameter's file is deleted when the parameter is freed (nothing
        empties these folders while the process runs)."""

        def _configure_aio(self, ds_config: Any) -> None:
            swap_config = ds_config.zero_config.offload_param
            given, number = swap_config.nvme_path, next(_swappers_made)
            if number:
                swap_config.nvme_path = os.path.join(str(given), f"model{number}")
            try:
                super()._configure_aio(ds_config)
            finally:
                swap_config.nvme_path = given

        def _get_swap_paths(self, params: Any, must_exist: bool = False) -> Any:
            known = set(self.id_to_path)
            paths = super()._get_swap_paths(params, must_exist=must_exist)
            for param, path in zip(params, paths, strict=True):
                if param.ds_id not in known:  # a file named for it just now: gone with the parameter
                    weakref.finalize(param, _remove_file, path)
            return paths

        def swap_in(self, params: Any, async_op: bool = True, swap_in_buffers: Any = None) -> Any:
            if swap_in_buffers is None:
                params = list({id(param): param for param in params}.values())
            return super().swap_in(params, async_op=async_op, swap_in_buffers=swap_in_buffers)

    class GrowingParameterSwapper(ParameterSwapper, _Growing):
        """DeepSpeed's parameter swapper starting with small buffers and growing them, while none is in use, to the
        largest partition it is asked to hold (a model being built under ``zero.Init``)."""

        buffers: Any
        available_buffer_ids: list[int]
        param_buffer_count: int
        elements_per_buffer: int
        aligned_elements_per_buffer: int

        def _configure_aio(self, ds_config: Any) -> None:
            swap_config = ds_config.zero_config.offload_param
            given = swap_config.buffer_size
            swap_config.buffer_size = 1  # the count stays: loading weights gathers a module's parameters together
            try:
                super()._configure_aio(ds_config)
            finally:
                swap_config.buffer_size = given

        def resize(self, elements: int, count: int) -> None:
            """Buffers for ``count`` partitions of up to ``elements`` elements (all buffers must be free)."""
            if self.reserved_buffer_ids or len(self.available_buffer_ids) != self.param_buffer_count:
                raise RuntimeError("lightspeed: the NVMe parameter swapper cannot be resized while a buffer is in use")
            self.aio_read_handle.free_cpu_locked_tensor(self.buffers)
            self.buffers = None
            self.elements_per_buffer = elements
            self.aligned_elements_per_buffer = self._io_aligned_numel(elements)
            self.param_buffer_count = count
            self.available_buffer_ids = list(range(count))
            numel = int(self.aligned_elements_per_buffer * count)
            self.buffers = self.aio_read_handle.new_cpu_locked_tensor(numel, torch.empty(0, dtype=self.dtype))

        def get_buffer(self, param: Any, numel: int) -> Any:
            if numel > self.elements_per_buffer and len(self.available_buffer_ids) == self.param_buffer_count:
                self.resize(numel, self.param_buffer_count)
            return super().get_buffer(param, numel)

    return ParameterSwapper, GrowingParameterSwapper


def remove_swap_files(engine: Any) -> None:
    """Delete ``engine``'s optimizer swap files (weights, states, gradients): for an engine that will not run again
    (released). A process that builds engine after engine, such as the tuner's trials, would otherwise fill the disk
    with dead files. Its parameters' files stay: the model may train again under a new engine; each goes when its
    parameter is freed (see ``ParameterSwapper``)."""
    swapper = getattr(getattr(engine, "optimizer", None), "optimizer_swapper", None)
    for info in getattr(swapper, "swap_params_info", {}).values():
        for path in [*info.get_swap_paths(), *info.get_swap_gradient_paths()]:
            _remove_file(path)


def _remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@contextlib.contextmanager
def lightspeed_parameter_swapper(config: dict[str, Any]) -> Iterator[None]:
    """Within the block, a ``zero.Init`` under ``config`` with parameters on NVMe gets lightspeed's parameter swapper,
    which swaps each parameter in once however often DeepSpeed's prefetch lists it; without an
    ``offload_param.buffer_size`` of the user's it also starts small and grows to the model's partitions (see the
    module's docstring). Otherwise (and with GPUDirect Storage, ``aio.use_gds``, whose buffers live on the GPU) a
    no-op. Enter it before ``zero.Init``."""
    zero = config.get("zero_optimization")
    offload = zero.get("offload_param") if isinstance(zero, dict) else None
    direct_to_gpu = bool((config.get("aio") or {}).get("use_gds"))  # GPUDirect Storage: buffers on the device
    if not isinstance(offload, dict) or offload.get("device") != "nvme" or direct_to_gpu:
        yield
        return
    from deepspeed.runtime.zero import partition_parameters

    once, growing = _swapper_classes()
    original = partition_parameters.AsyncPartitionedParameterSwapper
    partition_parameters.AsyncPartitionedParameterSwapper = once if "buffer_size" in offload else growing
    try:
        yield
    finally:
        partition_parameters.AsyncPartitionedParameterSwapper = original
