"""Measure what the estimate needs: a model's counts (without allocating it) and this machine's memory."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from collections.abc import Callable

import torch

from lightspeed.core.errors import MemoryPlanError
from lightspeed.core.zero.planner.accounting import ModelCounts
from lightspeed.core.zero.planner.selection import Budgets


def count_parameters(model: torch.nn.Module) -> ModelCounts:
    """Total parameters (shared ones once) and the largest layer (a module's own parameters), as DeepSpeed counts.

    DeepSpeed deduplicates shared parameters by ``data_ptr()``, which is 0 for every tensor on the meta device;
    here they are deduplicated by identity, which gives the same count and also works on meta tensors.
    """
    unique = {id(p): p.numel() for p in model.parameters()}
    total = sum(unique.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    if total == 0:
        raise MemoryPlanError(
            f"{type(model).__name__} has no parameters. If it creates its layers in configure_model(), "
            "estimate with a factory that returns the built model, or pass --params and --largest-layer."
        )
    return ModelCounts(total, largest)


def resolve_factory(path: str) -> Callable[[], object]:
    """The callable named by ``package.module:attribute`` (a function or an ``nn.Module`` class)."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise MemoryPlanError(
            f"Cannot read model factory {path!r}: write it as package.module:function (or :ClassName), "
            "e.g. my_pkg.models:build_model."
        )
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`, let factories in the current directory import
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise MemoryPlanError(
            f"Cannot import {module_name!r} for model factory {path!r}: {error}. Check the spelling, and that the "
            "package is installed or the command runs from the directory that contains it."
        ) from None
    obj = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise MemoryPlanError(f"Module {module_name!r} has no attribute {attribute!r} (model factory {path!r}).")
        obj = getattr(obj, part)
    if not callable(obj):
        raise MemoryPlanError(f"{path!r} is a {type(obj).__name__}, not a function or class that builds a model.")
    return obj


def counts_from_factory(path: str) -> ModelCounts:
    """Build the model named by ``path`` on the meta device (no memory, even for 70B parameters) and count it."""
    factory = resolve_factory(path)
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise MemoryPlanError(
            f"Model factory {path!r} returned a {type(model).__name__}, not a torch.nn.Module: "
            "make it return the model."
        )
    return count_parameters(model)


def host_memory_available() -> int:
    """Bytes of host memory available to new allocations now (psutil's ``available``)."""
    import psutil

    return int(psutil.virtual_memory().available)


def cuda_memory_free(device: torch.device | None = None) -> int | None:
    """Free bytes on the CUDA ``device``, or on the visible CUDA device with the least free memory when ``device``
    is None (the tightest one decides); ``None`` without CUDA."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    if device is not None:
        return int(torch.cuda.mem_get_info(device)[0])
    return min(int(torch.cuda.mem_get_info(i)[0]) for i in range(torch.cuda.device_count()))


def nvme_free(path: str | os.PathLike | None) -> int | None:
    """Free bytes at ``path`` (the nearest existing parent), ``None`` when no path is given."""
    if path is None:
        return None
    probe = os.path.abspath(os.fspath(path))
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return int(shutil.disk_usage(probe).free)


def measure_budgets(
    device_memory: int | None = None,
    host_memory: int | None = None,
    nvme_path: str | os.PathLike | None = None,
    device: torch.device | None = None,
) -> Budgets:
    """The budgets to plan with: each override (bytes) as given, everything else measured on this machine now.

    ``device`` is the accelerator the job trains on: a CUDA device measures that device's free memory, a CPU
    device gives no device budget (CPU processes share host memory), and ``None`` measures the tightest visible
    GPU (no device budget without one). With an ``nvme_path`` the budget also says whether NVMe offload can run
    here at all (DeepSpeed's async_io op).
    """
    if device_memory is None and (device is None or device.type == "cuda"):
        device_memory = cuda_memory_free(device)
    if host_memory is None:
        host_memory = host_memory_available()
    unusable = None
    if nvme_path:
        from lightspeed.core.zero.runtime import async_io_problem

        unusable = async_io_problem()
    return Budgets(device_memory, host_memory, nvme_free(nvme_path), unusable)
