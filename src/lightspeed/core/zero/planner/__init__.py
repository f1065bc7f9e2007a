"""Memory planner: DeepSpeed-compatible estimates of ZeRO model-state memory, and the choice of the fastest
option that fits a machine. Plain PyTorch; no Lightning imports."""

from lightspeed.core.common.sizes import GIB, format_gib, format_short, format_size
from lightspeed.core.zero.planner.accounting import (
    ZERO_OPTIONS,
    Accounting,
    Cluster,
    DeviceMemory,
    HostMemory,
    ModelCounts,
    OptionEstimate,
    ZeroOption,
    estimate_all,
    estimate_option,
    parse_count,
)
from lightspeed.core.zero.planner.measure import (
    count_parameters,
    counts_from_factory,
    cuda_memory_free,
    host_memory_available,
    measure_budgets,
    nvme_free,
    resolve_factory,
)
from lightspeed.core.zero.planner.report import format_table, plan_to_dict
from lightspeed.core.zero.planner.selection import (
    DEFAULT_SAFETY_MARGIN,
    Budgets,
    Plan,
    Verdict,
    assess,
    explain_no_fit,
    plan,
    suggestions,
)

__all__ = [
    "ZERO_OPTIONS",
    "Accounting",
    "Cluster",
    "DeviceMemory",
    "HostMemory",
    "ModelCounts",
    "OptionEstimate",
    "ZeroOption",
    "estimate_all",
    "estimate_option",
    "count_parameters",
    "counts_from_factory",
    "cuda_memory_free",
    "host_memory_available",
    "measure_budgets",
    "nvme_free",
    "resolve_factory",
    "format_table",
    "plan_to_dict",
    "DEFAULT_SAFETY_MARGIN",
    "Budgets",
    "Plan",
    "Verdict",
    "assess",
    "explain_no_fit",
    "plan",
    "suggestions",
    "GIB",
    "format_gib",
    "format_short",
    "format_size",
    "parse_count",
]
