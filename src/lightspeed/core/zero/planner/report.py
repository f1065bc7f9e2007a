"""Show a plan: a readable table for people, a dict (for ``--json``) for programs."""

from __future__ import annotations

from typing import Any

from lightspeed.core.common.sizes import format_short, format_size
from lightspeed.core.zero.planner.selection import Plan

_HEAD = (
    f"{'':24} |{'per device':^34}|{'per host (per node)':^41}|{'NVMe':^8}|\n"
    f"{'option':24} |{'params':>8}{'grads':>8}{'optim':>8}{'total':>9} |"
    f"{'load':>8}{'params':>8}{'grads':>8}{'optim':>8}{'total':>8} |{'/node':>7} | fits"
)


def _budget_line(result: Plan) -> str:
    b = result.budgets
    device = "devices share host memory" if b.device_memory is None else f"{format_size(b.device_memory)} per device"
    if b.nvme_unusable:
        nvme = f"NVMe unusable ({b.nvme_unusable})"
    elif b.nvme_free is None:
        nvme = "no NVMe path"
    else:
        nvme = f"NVMe {format_size(b.nvme_free)} free"
    host = format_size(b.host_memory)
    return f"Budget: {device}, {host} host memory per node, {nvme}; safety margin {result.safety_margin:.0%}."


def format_table(result: Plan, names: dict[str, str] | None = None) -> str:
    """The estimate of every option, which fit, and the choice; ``names`` renames options (e.g. to strategy names)."""
    names = names or {}
    c, a = result.counts, result.accounting
    lines = [
        f"Model: {c.total_params:,} parameters, largest layer {c.largest_layer_params:,}; precision {a.precision}, "
        f"{a.optimizer_state_bytes} bytes of optimizer state per parameter"
        f"{', zero.Init' if a.zero_init else ''}.",
        f"Job: {result.cluster.nodes} node(s) x {result.cluster.devices_per_node} device(s) = "
        f"{result.cluster.total_devices} processes.",
        _budget_line(result),
        "Model states only (activations are not counted); host memory includes DeepSpeed's buffer factor "
        f"{a.buffer_factor}. Sizes in bytes: K/M/G/T = 2^10/2^20/2^30/2^40.",
        "",
    ]
    if result.budgets.device_memory is None:
        lines[-1:-1] = [
            "CPU ranks hold both columns in one memory: each option is judged by its measured peak per process "
            "(below the table), not by the sum of the columns."
        ]
    lines.append(_HEAD)
    fmt = format_short

    for verdict in result.verdicts:
        e = verdict.estimate
        d, h = e.device, e.host
        mark = "<- chosen" if verdict is result.choice else ("yes" if verdict.fits else "no")
        lines.append(
            f"{names.get(e.option.name, e.option.name):24} |"
            f"{fmt(d.params):>8}{fmt(d.grads):>8}{fmt(d.optimizer):>8}{fmt(d.total):>9} |"
            f"{fmt(h.load):>8}{fmt(h.params):>8}{fmt(h.grads):>8}{fmt(h.optimizer):>8}"
            f"{fmt(h.total):>8} |{fmt(e.nvme_per_node) if e.nvme_per_node else '-':>7} | {mark}"
        )
    lines.append("")
    for verdict in result.verdicts:
        lines.append(f"  {names.get(verdict.estimate.option.name, verdict.estimate.option.name)}: {verdict.reason}")
    if result.choice is not None:
        chosen = result.choice.estimate.option
        lines.append(
            f"Choice: {names.get(chosen.name, chosen.name)} ({chosen.description}), the fastest option that fits."
        )
    else:
        lines.append("Choice: none; no option fits.")
    return "\n".join(lines)


def plan_to_dict(result: Plan, names: dict[str, str] | None = None) -> dict[str, Any]:
    """The plan as JSON-ready data: every size in bytes."""
    names = names or {}
    options = []
    for verdict in result.verdicts:
        e = verdict.estimate
        options.append(
            {
                "name": names.get(e.option.name, e.option.name),
                "stage": e.option.stage,
                "offload_optimizer": e.option.offload_optimizer,
                "offload_parameters": e.option.offload_parameters,
                "device_bytes": {
                    "params": e.device.params,
                    "grads": e.device.grads,
                    "optimizer": e.device.optimizer,
                    "total": e.device.total,
                },
                "host_bytes_per_node": {
                    "load": e.host.load,
                    "params": e.host.params,
                    "grads": e.host.grads,
                    "optimizer": e.host.optimizer,
                    "total": e.host.total,
                },
                "nvme_bytes_per_node": e.nvme_per_node,
                "cpu_process_peak_bytes": e.cpu_process_peak,
                "fits": verdict.fits,
                "reason": verdict.reason,
            }
        )
    b = result.budgets
    return {
        "model": {
            "total_params": result.counts.total_params,
            "largest_layer_params": result.counts.largest_layer_params,
        },
        "cluster": {"nodes": result.cluster.nodes, "devices_per_node": result.cluster.devices_per_node},
        "accounting": {
            "precision": result.accounting.precision,
            "optimizer_state_bytes": result.accounting.optimizer_state_bytes,
            "buffer_factor": result.accounting.buffer_factor,
            "zero_init": result.accounting.zero_init,
        },
        "budgets": {
            "device_bytes": b.device_memory,
            "host_bytes_per_node": b.host_memory,
            "nvme_free_bytes": b.nvme_free,
            "nvme_unusable": b.nvme_unusable,
        },
        "safety_margin": result.safety_margin,
        "options": options,
        "choice": names.get(result.choice.estimate.option.name, result.choice.estimate.option.name)
        if result.choice
        else None,
    }
