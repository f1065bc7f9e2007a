"""Pick the fastest ZeRO option whose estimate fits the memory budgets, or say what would make one fit.

A budget is usable up to ``1 - safety_margin`` of its size. The default margin of 20% is for what the estimate
leaves out on purpose, as DeepSpeed's does: activations, communication buckets (DeepSpeed's default reduce and
all-gather buckets are 5e8 elements each), the CUDA context (about 0.5-1 GiB) and allocator fragmentation.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from lightspeed.core.common.sizes import format_size
from lightspeed.core.errors import MemoryPlanError
from lightspeed.core.zero.config.low_memory import low_memory_conflict
from lightspeed.core.zero.planner.accounting import (
    ZERO_OPTIONS,
    Accounting,
    Cluster,
    ModelCounts,
    OptionEstimate,
    ZeroOption,
    estimate_all,
)

DEFAULT_SAFETY_MARGIN = 0.2


@dataclass(frozen=True)
class Budgets:
    """Memory available to the job.

    ``device_memory`` is per accelerator; ``None`` means the devices are CPU processes that share the host memory
    with everything else. ``host_memory`` is per node. ``nvme_free`` is the free space at the NVMe path, ``None``
    when there is none; ``nvme_unusable`` says why NVMe offload cannot run here even with a path (e.g. no async_io).
    """

    device_memory: int | None
    host_memory: int
    nvme_free: int | None = None
    nvme_unusable: str | None = None

    def __post_init__(self) -> None:
        if self.device_memory is not None and self.device_memory <= 0:
            raise MemoryPlanError(f"Device memory must be positive, got {self.device_memory} bytes.")
        if self.host_memory <= 0:
            raise MemoryPlanError(f"Host memory must be positive, got {self.host_memory} bytes.")


@dataclass(frozen=True)
class Verdict:
    """Whether one option's estimate fits the budgets, and the numbers that decided it."""

    estimate: OptionEstimate
    fits: bool
    reason: str


@dataclass(frozen=True)
class Plan:
    """Every option's verdict, fastest first, and the chosen one (``None`` when nothing fits)."""

    counts: ModelCounts
    cluster: Cluster
    accounting: Accounting
    budgets: Budgets
    safety_margin: float
    verdicts: list[Verdict]
    choice: Verdict | None


def _usable(size: int, margin: float) -> int:
    return int(size * (1 - margin))


def assess(estimate: OptionEstimate, budgets: Budgets, cluster: Cluster, safety_margin: float) -> Verdict:
    """Does ``estimate`` fit ``budgets`` with ``safety_margin`` of each kept free?"""
    problems: list[str] = []
    details: list[str] = []
    host_usable = _usable(budgets.host_memory, safety_margin)
    if budgets.device_memory is None:
        # CPU processes: each holds its states in the one host memory, as DeepSpeed on the CPU does
        need = estimate.cpu_process_peak * cluster.devices_per_node
        text = (
            f"host {format_size(need)} ({format_size(estimate.cpu_process_peak)} per process) of "
            f"{format_size(host_usable)} usable (devices share host memory)"
        )
        (problems if need > host_usable else details).append(text)
    else:
        device_usable = _usable(budgets.device_memory, safety_margin)
        text = f"device {format_size(estimate.device.total)} of {format_size(device_usable)} usable"
        (problems if estimate.device.total > device_usable else details).append(text)
        text = f"host {format_size(estimate.host.total)} of {format_size(host_usable)} usable"
        (problems if estimate.host.total > host_usable else details).append(text)
    if estimate.nvme_per_node:
        if budgets.nvme_unusable:
            problems.append(budgets.nvme_unusable)
        elif budgets.nvme_free is None:
            problems.append(f"needs an NVMe path with {format_size(estimate.nvme_per_node)} free")
        else:
            nvme_usable = _usable(budgets.nvme_free, safety_margin)
            text = f"NVMe {format_size(estimate.nvme_per_node)} of {format_size(nvme_usable)} usable"
            (problems if estimate.nvme_per_node > nvme_usable else details).append(text)
    if problems:
        return Verdict(estimate, False, "too big: " + "; ".join(problems))
    return Verdict(estimate, True, "fits: " + "; ".join(details))


def _runnable(accounting: Accounting, estimate: OptionEstimate) -> Verdict | None:
    """The verdict of an option DeepSpeed cannot run with the low-memory bf16 states asked for; None if it can."""
    option = estimate.option
    master, states = accounting.bf16_master_weights_and_grads, accounting.bf16_optimizer_states
    conflict = low_memory_conflict(option.offload_optimizer, master, states)
    return None if conflict is None else Verdict(estimate, False, f"cannot run: {conflict}")


def plan(
    counts: ModelCounts,
    cluster: Cluster,
    budgets: Budgets,
    accounting: Accounting = Accounting(),
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    options: tuple[ZeroOption, ...] = ZERO_OPTIONS,
) -> Plan:
    """Estimate every option, assess each against the budgets and choose the first (fastest) that fits."""
    if not 0 <= safety_margin < 1:
        raise MemoryPlanError(
            f"The safety margin is a fraction of memory kept free, between 0 and 1; got {safety_margin}."
        )
    verdicts = [
        _runnable(accounting, e) or assess(e, budgets, cluster, safety_margin)
        for e in estimate_all(counts, cluster, accounting, options)
    ]
    choice = next((v for v in verdicts if v.fits), None)
    return Plan(counts, cluster, accounting, budgets, safety_margin, verdicts, choice)


def suggestions(result: Plan, max_nodes: int = 1024) -> list[str]:
    """What would make an option fit when none does: more nodes, NVMe offload, 16-bit precision, zero.Init.

    Each remedy is tried alone, then in combinations; only the smallest combinations that work are reported.
    """
    remedies: list[str] = []
    if result.budgets.nvme_free is None and result.budgets.nvme_unusable is None:
        remedies.append("nvme")
    if result.accounting.param_bytes > 2:
        remedies.append("precision")
    if not result.accounting.zero_init:
        remedies.append("zero_init")
    remedies.append("nodes")

    def attempt(chosen: tuple[str, ...]) -> str | None:
        budgets, accounting = result.budgets, result.accounting
        if "nvme" in chosen:
            budgets = dataclasses.replace(budgets, nvme_free=2**62)
        if "precision" in chosen:
            accounting = dataclasses.replace(accounting, precision="bf16-mixed")
        if "zero_init" in chosen:
            accounting = dataclasses.replace(accounting, zero_init=True)
        node_counts = [result.cluster.nodes]
        if "nodes" in chosen:
            node_counts = []
            nodes = result.cluster.nodes * 2
            while nodes <= max_nodes:
                node_counts.append(nodes)
                nodes *= 2
        for nodes in node_counts:
            cluster = dataclasses.replace(result.cluster, nodes=nodes)
            hit = plan(result.counts, cluster, budgets, accounting, result.safety_margin).choice
            if hit is None or ("nvme" in chosen and not hit.estimate.nvme_per_node):
                continue
            parts = []
            if "nodes" in chosen:
                parts.append(f"{nodes} nodes of {cluster.devices_per_node} devices ({cluster.total_devices} in all)")
            if "nvme" in chosen:
                free = hit.estimate.nvme_per_node / (1 - result.safety_margin)
                parts.append(f"an NVMe path with {format_size(free)} free per node (--nvme-path)")
            if "precision" in chosen:
                parts.append("bf16-mixed (or 16-mixed) precision")
            if "zero_init" in chosen:
                parts.append("the model built partitioned (Lightning's configure_model, i.e. deepspeed.zero.Init)")
            return f"{' + '.join(parts)} would fit {hit.estimate.option.name}"
        return None

    found: list[str] = []
    working: list[set[str]] = []
    for size in range(1, len(remedies) + 1):
        for chosen in itertools.combinations(remedies, size):
            if any(done <= set(chosen) for done in working):
                continue
            text = attempt(chosen)
            if text is not None:
                found.append(text)
                working.append(set(chosen))
    return found


def explain_no_fit(result: Plan) -> str:
    """The error message for a plan with no fitting option: the smallest need, and what would fit."""
    if result.budgets.device_memory is None:  # CPU processes: one memory
        smallest = min(result.verdicts, key=lambda v: v.estimate.cpu_process_peak)
    else:
        smallest = min(result.verdicts, key=lambda v: (v.estimate.device.total, v.estimate.host.total))
    lines = [
        f"No ZeRO option fits {result.counts.total_params:,} parameters on {result.cluster.nodes} node(s) x "
        f"{result.cluster.devices_per_node} device(s) with a {result.safety_margin:.0%} safety margin. "
        f"The smallest, {smallest.estimate.option.name}, is {smallest.reason}."
    ]
    ideas = suggestions(result)
    if ideas:
        lines.append("What would fit: " + "; or ".join(ideas) + ".")
    else:
        lines.append(
            "Neither more nodes, NVMe offload, 16-bit precision nor zero.Init would make an option fit: use a "
            "smaller model or devices with more memory."
        )
    return "\n".join(lines)
