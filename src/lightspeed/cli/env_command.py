"""``lightspeed env``: what a bug report needs: versions, devices, usable DeepSpeed ops, runnable strategies."""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.metadata
import json
import os
import platform
import shutil
import sys
from typing import Any

from lightspeed.cli.usage import EXIT_OK, Command
from lightspeed.core.xla.runtime import torch_xla_install_hint
from lightspeed.core.zero.config import NVME_PATH_ENV
from lightspeed.core.zero.runtime import (
    TORCH_EXTENSIONS_ENV,
    export_deepspeed_accelerator,
    torch_extensions_root,
    venv_torch_extensions_dir,
)

PACKAGES = ("torch", "lightning", "deepspeed", "torch_xla", "torchmetrics", "safetensors", "transformers", "lightspeed")
# ops lightspeed's strategies use, and why
KEY_OPS = {
    "cpu_adam": "optimizer offload (zero*_offload, zero3_nvme)",
    "async_io": "NVMe offload (zero3_nvme)",
    "fused_adam": "fused Adam on CUDA",
}
_DISTRIBUTIONS = {"torch_xla": "torch-xla"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``lightspeed env``."""
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def package_versions() -> dict[str, str | None]:
    """Installed version of each package (None when missing), read from metadata without importing it."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(_DISTRIBUTIONS.get(name, name))
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def devices() -> dict[str, Any]:
    """CUDA devices (name, memory), CPU cores, host memory."""
    import psutil
    import torch

    info: dict[str, Any] = {
        "cpu_cores": os.cpu_count(),
        "host_memory_total_bytes": int(psutil.virtual_memory().total),
        "host_memory_available_bytes": int(psutil.virtual_memory().available),
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "cuda_devices": [],
    }
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            info["cuda_devices"].append({"index": index, "name": props.name, "memory_bytes": int(props.total_memory)})
    return info


def extension_cache() -> dict[str, str]:
    """Where DeepSpeed's JIT-compiled ops are loaded from and built into, and why that directory."""
    root = torch_extensions_root()
    if os.environ.get(TORCH_EXTENSIONS_ENV) is None:
        source = "torch's default (TORCH_EXTENSIONS_DIR unset); one subfolder per Python/device build"
    elif os.path.realpath(root) == os.path.realpath(venv_torch_extensions_dir()):
        source = "this environment's prebuilt ops, from scripts/setup.sh"
    else:
        source = "TORCH_EXTENSIONS_DIR"
    return {"path": str(root), "source": source}


def _jit_cached(op_name: str) -> bool:
    """Whether torch's extension cache already holds a compiled ``op_name`` (built by an earlier run)."""
    root = str(torch_extensions_root())
    if os.environ.get(TORCH_EXTENSIONS_ENV) is not None:  # TORCH_EXTENSIONS_DIR/<op>/<op>.so
        return bool(glob.glob(os.path.join(glob.escape(root), op_name, "*.so")))
    return bool(glob.glob(os.path.join(glob.escape(root), "*", op_name, "*.so")))  # <root>/py311_cpu/<op>/<op>.so


def compiler_available() -> bool:
    """A C++ compiler and ninja, which DeepSpeed needs to compile ops on first use."""
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    return shutil.which(compiler) is not None and is_ninja_available()


def deepspeed_ops(kind: str | None = None) -> dict[str, dict[str, Any]]:
    """Every DeepSpeed op for the ``kind`` of device ("cpu" or "cuda"; default: "cuda" when a GPU is visible, else
    "cpu"): prebuilt, compiled in the cache, compatible, usable."""
    if kind is None:
        import torch

        kind = "cuda" if torch.cuda.is_available() else "cpu"
    export_deepspeed_accelerator(kind)  # before DeepSpeed is imported: its op builders follow the accelerator
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    can_compile = compiler_available()
    report: dict[str, dict[str, Any]] = {}
    for name, builder in sorted(ALL_OPS.items()):
        if name == "deepspeed_not_implemented":
            continue
        try:
            compatible = bool(builder.is_compatible(verbose=False))
        except Exception:  # noqa: BLE001 - a failing probe means "not compatible"
            compatible = False
        prebuilt, cached = bool(installed_ops.get(name, False)), _jit_cached(name)
        usable = prebuilt or cached or (compatible and can_compile)
        if usable:
            why = (
                "prebuilt" if prebuilt else ("compiled (torch extension cache)" if cached else "compiles on first use")
            )
        elif not compatible and name == "async_io":
            why = "missing libaio: apt-get install libaio-dev"
        elif not compatible:
            why = "not compatible with this system"
        else:
            why = "needs a C++ compiler and ninja: apt-get install build-essential; pip install ninja"
        report[name] = {"usable": usable, "prebuilt": prebuilt, "cached": cached, "compatible": compatible, "why": why}
    return report


def strategies(ops: dict[str, dict[str, Any]] | None, versions: dict[str, str | None]) -> dict[str, str | None]:
    """Each lightspeed strategy name -> None when it can run here, else the reason it cannot."""
    from lightning.pytorch.strategies import StrategyRegistry

    import lightspeed  # noqa: F401 - registers the names

    def op_problem(op: str) -> str | None:
        if ops is None:
            return "DeepSpeed is not installed (pip install deepspeed)"
        entry = ops.get(op)
        if entry is None:
            return f"DeepSpeed has no {op} op for this accelerator"
        return None if entry["usable"] else f"DeepSpeed's {op} op is not usable: {entry['why']}"

    result: dict[str, str | None] = {}
    for name in sorted(StrategyRegistry):
        entry = StrategyRegistry[name]
        module = getattr(entry["strategy"], "__module__", "")
        if not module.startswith("lightspeed."):
            continue
        params = entry.get("init_params", {})
        problem: str | None = None
        if "xla" in module:
            problem = (
                None if versions.get("torch_xla") else f"needs torch_xla and an XLA device; {torch_xla_install_hint()}"
            )
        elif "zero" in module:
            if ops is None:
                problem = op_problem("cpu_adam")
            else:
                targets = {params.get("offload_optimizer", "none"), params.get("offload_parameters", "none")}
                if targets & {"cpu", "nvme"}:
                    problem = op_problem("cpu_adam")
                if problem is None and "nvme" in targets:
                    problem = op_problem("async_io")
                    if problem is None and not os.environ.get(NVME_PATH_ENV):
                        problem = f"can run, given nvme_path= or ${NVME_PATH_ENV} (a directory on an NVMe drive)"
        result[name] = problem
    return result


def collect() -> dict[str, Any]:
    """Everything ``lightspeed env`` reports, as data."""
    versions = package_versions()
    ops = None
    if versions.get("deepspeed"):
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout on import
            ops = deepspeed_ops()
    return {
        "versions": versions,
        "platform": platform.platform(),
        "devices": devices(),
        "compiler_and_ninja": compiler_available(),
        "extension_cache": extension_cache(),
        "deepspeed_ops": ops,
        "strategies": strategies(ops, versions),
    }


def format_report(data: dict[str, Any]) -> str:
    gib = 2**30
    lines = ["Versions"]
    for name, version in data["versions"].items():
        lines.append(f"  {name:14} {version or 'not installed'}")
    dev = data["devices"]
    lines += [
        "",
        "Devices",
        f"  platform       {data['platform']}",
        f"  CPU cores      {dev['cpu_cores']}",
        f"  host memory    {dev['host_memory_total_bytes'] / gib:.1f} GiB total, "
        f"{dev['host_memory_available_bytes'] / gib:.1f} GiB available",
    ]
    if dev["cuda_devices"]:
        lines.append(f"  CUDA           {dev['cuda_version']}, {len(dev['cuda_devices'])} device(s)")
        for cuda in dev["cuda_devices"]:
            lines.append(f"    cuda:{cuda['index']}       {cuda['name']}, {cuda['memory_bytes'] / gib:.1f} GiB")
    else:
        lines.append("  CUDA           no GPU visible (ZeRO strategies run on the CPU with gloo)")
    lines += ["", f"DeepSpeed ops (C++ compiler and ninja: {'yes' if data['compiler_and_ninja'] else 'no'})"]
    cache = data["extension_cache"]
    lines.append(f"  compiled ops in {cache['path']} ({cache['source']})")
    if data["deepspeed_ops"] is None:
        lines.append("  DeepSpeed is not installed")
    else:
        for name, op in data["deepspeed_ops"].items():
            use = f"  <- {KEY_OPS[name]}" if name in KEY_OPS else ""
            lines.append(f"  {name:22} {'usable' if op['usable'] else 'NOT usable':10} {op['why']}{use}")
    lines += ["", "lightspeed strategies"]
    for name, problem in data["strategies"].items():
        lines.append(f"  {name:24} {'ok' if problem is None else problem}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    data = collect()
    print(json.dumps(data, indent=2) if args.json else format_report(data))
    return EXIT_OK


COMMAND = Command(
    name="env",
    help="versions, devices, usable DeepSpeed ops and which lightspeed strategies can run here",
    description="Print what a bug report needs: versions of Python and the libraries lightspeed uses, the devices, "
    "which DeepSpeed ops can be used (prebuilt, already compiled, or compilable) and which lightspeed strategies can "
    "run on this machine, and why not.",
    add_arguments=add_arguments,
    run=run,
)
