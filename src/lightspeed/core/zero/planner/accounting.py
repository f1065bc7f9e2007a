"""Memory of ZeRO model states per device and per host, with DeepSpeed's own accounting.

DeepSpeed's estimators (``estimate_zero2_model_states_mem_needs`` and ``estimate_zero3_model_states_mem_needs``)
count, per parameter, 2 bytes for the 16-bit weights plus 18 bytes of training state (2 for 16-bit gradients,
4 for fp32 gradients, 4 for the fp32 master weights and 8 for Adam's two moments); ZeRO-3 adds 4 bytes per
parameter of the largest layer (the gathered layer and its gradient), and host memory is multiplied by a buffer
factor of 1.5. Here every term is kept separately (parameters, gradients, optimizer states) so the table can show
where memory goes, and the same terms are extended to ZeRO-1 (gradients not partitioned), to ZeRO-3 with only the
parameters offloaded, to NVMe offload (pinned swap buffers in host memory, the states on disk), to several nodes
(host memory is per node) and to fp32 training (4-byte weights and gradients).

Only model states are counted; activations, communication buckets and the CUDA context are not (that is what the
planner's safety margin is for).

When the devices are CPU processes, device and host memory are one, and DeepSpeed's split does not describe what a
process holds: the model the process builds *is* its ZeRO-1/2 weights (not a second copy), ZeRO-3 keeps every
gathered layer until backward, and torch's optimizer step allocates a partition-sized temporary.
``OptionEstimate.cpu_process_peak`` counts that composition (:func:`cpu_process_peak`), measured against the peak
resident size of 2-rank runs at 50M and 403M parameters (``bench/planner_accuracy.py``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lightspeed.core.errors import MemoryPlanError
from lightspeed.core.zero.config.facts import PRECISIONS

_PARAM_BYTES = {precision: 4 if precision == "32-true" else 2 for precision in PRECISIONS}
"""Bytes of a weight in each precision lightspeed's ZeRO strategies accept (and only those: an estimate for a
precision the strategy rejects would plan a run that cannot start)."""
FP32_BYTES = 4
"""fp32 master weights and fp32 gradient partitions: 4 bytes each, whatever the training precision."""
LOAD_BYTES = 4
"""Each process builds the model in fp32 on the host before DeepSpeed partitions it (DeepSpeed counts 4 bytes)."""
GATHERED_PARAMETERS = 10**9
"""ZeRO-3 keeps up to ``stage3_max_live_parameters`` elements gathered between forward and backward (DeepSpeed's
default 1e9, with its default reuse distance; lightspeed keeps both except on NVMe): on the CPU the measured peak
holds every layer of a smaller model gathered."""


@dataclass(frozen=True)
class ModelCounts:
    """What the estimate needs to know about a model: its parameter count and its largest single layer."""

    total_params: int
    largest_layer_params: int

    def __post_init__(self) -> None:
        if self.total_params <= 0:
            raise MemoryPlanError(f"The parameter count must be positive, got {self.total_params}.")
        if self.largest_layer_params <= 0:
            raise MemoryPlanError(
                f"The largest layer's parameter count must be positive, got {self.largest_layer_params}."
            )
        if self.largest_layer_params > self.total_params:
            raise MemoryPlanError(
                f"The largest layer ({self.largest_layer_params}) cannot have more parameters than the whole model "
                f"({self.total_params}); check the two counts."
            )


@dataclass(frozen=True)
class Cluster:
    """The shape of the job: processes (devices) per node and number of nodes."""

    devices_per_node: int
    nodes: int = 1

    def __post_init__(self) -> None:
        if self.devices_per_node <= 0:
            raise MemoryPlanError(f"The number of devices per node must be at least 1, got {self.devices_per_node}.")
        if self.nodes <= 0:
            raise MemoryPlanError(f"The number of nodes must be at least 1, got {self.nodes}.")

    @property
    def total_devices(self) -> int:
        return self.devices_per_node * self.nodes


@dataclass(frozen=True)
class ZeroOption:
    """One way to run ZeRO: a stage and where the optimizer states and the parameters live."""

    name: str
    stage: int
    offload_optimizer: str = "none"
    offload_parameters: str = "none"
    description: str = ""


ZERO_OPTIONS: tuple[ZeroOption, ...] = (
    ZeroOption("zero1", 1, description="ZeRO-1: optimizer states partitioned"),
    ZeroOption("zero2", 2, description="ZeRO-2: + gradients partitioned"),
    ZeroOption("zero2_offload", 2, "cpu", description="ZeRO-2, optimizer states and step on the CPU"),
    ZeroOption("zero3", 3, description="ZeRO-3: + parameters partitioned"),
    ZeroOption("zero3_offload_optimizer", 3, "cpu", description="ZeRO-3, optimizer states and step on the CPU"),
    ZeroOption("zero3_offload_params", 3, "none", "cpu", description="ZeRO-3, parameters on the CPU"),
    ZeroOption("zero3_offload", 3, "cpu", "cpu", description="ZeRO-3, parameters and optimizer on the CPU"),
    ZeroOption("zero3_nvme", 3, "nvme", "nvme", description="ZeRO-3, parameters and optimizer on NVMe"),
)
"""Fastest first, in the order people try them: ZeRO-1, ZeRO-2, ZeRO-2 + optimizer offload, ZeRO-3, ZeRO-3 +
optimizer offload (DeepSpeed's estimator's middle row), ZeRO-3 + parameter offload (for a host too small for the
optimizer states), ZeRO-3 + both offloads, NVMe. The names are the registered strategy names, except
``zero3_offload_params`` (``ZeroStrategy(stage=3, offload_parameters="cpu")``)."""


@dataclass(frozen=True)
class Accounting:
    """Assumptions of the estimate; the defaults are DeepSpeed's (mixed precision, Adam, buffer factor 1.5)."""

    precision: str = "bf16-mixed"
    optimizer_state_bytes: int = 8
    """Per parameter: 8 for Adam/AdamW (two fp32 moments), 4 for SGD with momentum, 0 for plain SGD."""
    buffer_factor: float = 1.5
    """DeepSpeed's ``additional_buffer_factor``: host memory is multiplied by it."""
    zero_init: bool = False
    """ZeRO-3 only: the model is built partitioned (``deepspeed.zero.Init``, Lightning's ``configure_model``), so a
    process never holds more than the largest layer in full. Without it each process first builds the whole model."""
    nvme_param_buffer_count: int = 3
    """ZeRO-3 NVMe: parameter swap buffers per process (lightspeed: the parameters one module holds at once + 1)."""
    nvme_param_buffer_size: int | None = None
    """ZeRO-3 NVMe: elements per parameter swap buffer; None: the largest partition, as lightspeed sizes it."""
    nvme_optimizer_buffer_count: int = 4
    sub_group_size: int | None = None
    """ZeRO-3 NVMe: the optimizer's sub-group size; None: one parameter per sub-group, as lightspeed sets it."""
    bf16_master_weights_and_grads: bool = False
    """DeepSpeed's bf16 master weights and gradients (the strategies' argument of the same name): 2 bytes each."""
    bf16_optimizer_states: bool = False
    """DeepSpeed's bf16 optimizer moments: ``optimizer_state_bytes`` halved."""
    accumulate_grad_batches: int | None = 1
    """Micro-batches per optimizer step (None: not known, counted as several). ZeRO-3 NVMe: with one, a gradient
    partition's host memory is given back as soon as it is on NVMe; with several it holds the window's gradients."""

    def __post_init__(self) -> None:
        low_memory = self.bf16_master_weights_and_grads or self.bf16_optimizer_states
        if low_memory and self.precision not in ("bf16-mixed", "bf16-true"):
            raise MemoryPlanError(
                f"bf16 master weights or optimizer states need a bf16 precision ('bf16-mixed' or 'bf16-true'), "
                f"not {self.precision!r}."
            )
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise MemoryPlanError("bf16 optimizer states need bf16 master weights and gradients too.")
        if self.precision not in _PARAM_BYTES:
            raise MemoryPlanError(
                f"Unsupported precision {self.precision!r} for a ZeRO estimate: use one of "
                f"{', '.join(PRECISIONS)} (the Trainer precisions lightspeed's ZeRO strategies accept)."
            )
        if self.optimizer_state_bytes < 0:
            raise MemoryPlanError(f"optimizer_state_bytes must be 0 or more, got {self.optimizer_state_bytes}.")
        if self.buffer_factor < 1:
            raise MemoryPlanError(f"The buffer factor must be at least 1, got {self.buffer_factor}.")
        if self.accumulate_grad_batches is not None and self.accumulate_grad_batches < 1:
            raise MemoryPlanError(f"accumulate_grad_batches must be at least 1, got {self.accumulate_grad_batches}.")

    @property
    def param_bytes(self) -> int:
        """Bytes of one model weight (and of one model gradient) in the training precision."""
        return _PARAM_BYTES[self.precision]

    @property
    def master_bytes(self) -> int:
        """Bytes of one master weight, and of one gradient of the optimizer's partition: fp32, or bf16."""
        return 2 if self.bf16_master_weights_and_grads else FP32_BYTES

    @property
    def state_bytes(self) -> int:
        """Bytes of the optimizer's moments per parameter."""
        return self.optimizer_state_bytes // 2 if self.bf16_optimizer_states else self.optimizer_state_bytes


@dataclass(frozen=True)
class StateMemory:
    """Bytes of the three model states in one memory: parameters, gradients and optimizer states."""

    params: int
    grads: int
    optimizer: int

    @property
    def steady(self) -> int:
        """The three together: what stays allocated while training."""
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class DeviceMemory(StateMemory):
    """Bytes on each accelerator."""

    @property
    def total(self) -> int:
        return self.steady


@dataclass(frozen=True)
class HostMemory(StateMemory):
    """Bytes in the host memory of each node (all of its processes together).

    ``load`` is the model as the processes build it before DeepSpeed takes over; it is freed before the states
    are allocated, so the peak is the larger of the two, times the buffer factor.
    """

    load: int
    buffer_factor: float

    @property
    def total(self) -> int:
        return int(max(self.load, self.steady) * self.buffer_factor)


@dataclass(frozen=True)
class OptionEstimate:
    """The estimate for one option."""

    option: ZeroOption
    device: DeviceMemory
    host: HostMemory
    nvme_per_node: int
    cpu_process_peak: int
    """The peak resident bytes of one process when the devices are CPU processes (:func:`cpu_process_peak`)."""


def estimate_option(
    option: ZeroOption, counts: ModelCounts, cluster: Cluster, accounting: Accounting
) -> OptionEstimate:
    """Memory per device, per host and on NVMe for ``option``."""
    total, largest = counts.total_params, counts.largest_layer_params
    pb, ob, mb = accounting.param_bytes, accounting.state_bytes, accounting.master_bytes
    master_and_states = mb + ob  # master weights (fp32, or bf16) + optimizer moments, per parameter
    per_device = total / cluster.total_devices  # a partition
    per_node = total / cluster.nodes  # the partitions of one node's processes
    g = cluster.devices_per_node

    full_load = LOAD_BYTES * total * g
    load = full_load
    if option.stage == 3 and accounting.zero_init:
        # zero.Init creates each layer on the device and partitions it at once; like DeepSpeed's estimator, count
        # the largest layer per process in host memory only when nothing is offloaded (offloaded partitions go
        # to host memory layer by layer and are part of the steady state below)
        nothing_offloaded = option.offload_optimizer == "none" and option.offload_parameters == "none"
        load = LOAD_BYTES * largest * g if nothing_offloaded else 0
    host_params = host_grads = host_optimizer = 0.0
    nvme = 0.0

    if option.stage in (1, 2):
        if option.offload_parameters != "none":
            raise MemoryPlanError(f"{option.name}: parameter offload needs ZeRO stage 3.")
        dev_params: float = pb * total
        # ZeRO-1 keeps full 16-bit gradients on every device; ZeRO-2 keeps only its partition
        grads16 = pb * total if option.stage == 1 else pb * per_device
        if option.offload_optimizer == "none":
            dev_grads = grads16 + mb * per_device
            dev_optimizer = master_and_states * per_device
        elif option.offload_optimizer == "cpu":
            # gradients stream to the host bucket by bucket; fp32 gradients and the optimizer live there
            dev_grads = 0 if option.stage == 2 else grads16
            dev_optimizer = 0
            host_grads = mb * per_node
            host_optimizer = master_and_states * per_node
        else:
            raise MemoryPlanError(
                f"{option.name}: ZeRO-{option.stage} offloads the optimizer to 'cpu' only, "
                f"not {option.offload_optimizer!r}."
            )
    elif option.stage == 3:
        gathered = pb * largest  # the largest layer gathered in full during forward/backward
        params_on_device = option.offload_parameters == "none"
        optimizer_on_device = option.offload_optimizer == "none"
        if not params_on_device and option.offload_parameters != option.offload_optimizer and not optimizer_on_device:
            raise MemoryPlanError(f"{option.name}: offload parameters and optimizer to the same place (cpu or nvme).")
        dev_params = gathered + (pb * per_device if params_on_device else 0)
        dev_grads = gathered
        dev_optimizer = 0
        if optimizer_on_device:
            # DeepSpeed's ZeRO-3 estimate counts 18 bytes per partitioned parameter in mixed precision: the 16-bit
            # weight, 4 bytes of gradient (reduced straight into the partition) and 12 of fp32 weight and moments
            dev_grads += mb * per_device
            dev_optimizer = master_and_states * per_device
        if option.offload_parameters == "cpu":
            host_params = pb * per_node
        if option.offload_optimizer == "cpu":
            host_grads = mb * per_node
            host_optimizer = master_and_states * per_node
        if option.offload_optimizer == "nvme":
            # swapping sized from the model (core/zero/nvme_swapping.py): per process the gradient partition (in the
            # parameters' dtype; resident only between the micro-batches of a window, else one parameter's slot at a
            # time: core/zero/swapped_gradients.py), the parameter swap buffers, one full copy of the largest
            # parameter (DeepSpeed's partitioned swap buffer) and the optimizer swapper's fp32 buffers for one
            # sub-group (the weights, gradient and each moment); everything else is on disk
            partition = math.ceil(largest / cluster.total_devices)
            sub_group = partition
            if accounting.sub_group_size is not None:
                sub_group = min(math.ceil(per_device), accounting.sub_group_size + partition - 1)
            buffer = accounting.nvme_param_buffer_size or max(partition, sub_group)
            host_params = g * (accounting.nvme_param_buffer_count * buffer + largest) * pb
            host_grads = pb * (g * partition if accounting.accumulate_grad_batches == 1 else per_node)
            host_optimizer = g * accounting.nvme_optimizer_buffer_count * FP32_BYTES * sub_group
            nvme = (pb + mb + master_and_states) * per_node
        elif option.offload_parameters == "nvme":
            raise MemoryPlanError(f"{option.name}: NVMe parameter offload needs NVMe optimizer offload too.")
    else:
        raise MemoryPlanError(f"ZeRO stage must be 1, 2 or 3, got {option.stage}.")

    device = DeviceMemory(int(dev_params), int(dev_grads), int(dev_optimizer))
    host = HostMemory(
        int(host_params), int(host_grads), int(host_optimizer), load=int(load), buffer_factor=accounting.buffer_factor
    )
    return OptionEstimate(
        option=option,
        device=device,
        host=host,
        nvme_per_node=int(nvme),
        cpu_process_peak=cpu_process_peak(option, counts, cluster, accounting, device, host),
    )


def cpu_process_peak(
    option: ZeroOption,
    counts: ModelCounts,
    cluster: Cluster,
    accounting: Accounting,
    device: DeviceMemory,
    host: HostMemory,
) -> int:
    """Peak resident bytes of one CPU process: DeepSpeed's device and host states of one process, with what DeepSpeed
    on the CPU really holds instead of its estimator's assumptions (no buffer factor; the safety margin covers noise).

    - ZeRO-1/2: the model the process built is its weights (DeepSpeed flattens them in place of the originals), so
      the load is not a second copy; the optimizer step adds one fp32 partition (torch's Adam builds its denominator
      out of place).
    - ZeRO-3 (states in memory or offloaded to the CPU): the partitioned states, every gathered layer up to
      ``GATHERED_PARAMETERS`` in place of the estimator's largest layer twice, and the step's partition; the model
      built in full (without zero.Init) is below that peak.
    - ZeRO-3 on NVMe (lightspeed's sizing: reuse distance 0, swap buffers from the model): the larger of the model
      the process builds plus the parameter swap buffers (both live while DeepSpeed partitions and swaps it out; the
      optimizer's buffers are made after that), and the steady state (the buffers, and the gradient partition when
      the steps accumulate).
    - Part of the states offloaded to "the CPU" (``zero2_offload``, ``zero3_offload_optimizer``,
      ``zero3_offload_params``): nothing leaves the process's memory, and DeepSpeed's offload buffers come on top;
      measured 1.4-1.7x the option without offload at 50M parameters. Counted, on the safe side, as that option plus
      a second fp32 optimizer partition (master weights, gradient, moments): 0.8-1.2x measured.
    """
    partial_offload = (option.offload_optimizer == "cpu") != (option.offload_parameters == "cpu")
    if partial_offload:
        in_memory = dataclasses.replace(option, offload_optimizer="none", offload_parameters="none")
        second_copy = (2 * accounting.master_bytes + accounting.state_bytes) * counts.total_params
        return estimate_option(in_memory, counts, cluster, accounting).cpu_process_peak + int(
            second_copy / cluster.total_devices
        )
    g = cluster.devices_per_node
    states = device.total + host.steady / g
    load = host.load / g
    step_temporary = accounting.master_bytes * counts.total_params / cluster.total_devices
    if option.stage in (1, 2):
        return int(max(load, states + step_temporary))
    if option.offload_optimizer == "nvme":
        parameter_buffers = host.params / g  # the optimizer's come once the built model is partitioned (and gone)
        return int(max(load + parameter_buffers, states))
    gathered_layer_terms = 2 * accounting.param_bytes * counts.largest_layer_params  # in device.params and .grads
    gathered = accounting.param_bytes * min(counts.total_params, GATHERED_PARAMETERS)
    return int(max(load, states - gathered_layer_terms + gathered + step_temporary))


def estimate_all(
    counts: ModelCounts, cluster: Cluster, accounting: Accounting, options: tuple[ZeroOption, ...] = ZERO_OPTIONS
) -> list[OptionEstimate]:
    """The estimate of every option, fastest first."""
    return [estimate_option(option, counts, cluster, accounting) for option in options]


def parse_count(text: str | int | float, what: str) -> int:
    """A positive parameter count from ``7e9``, ``"1.3e8"`` or ``"125000000"``."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise MemoryPlanError(f"{what} must be a number such as 7e9, got {text!r}.") from None
    if not value > 0 or value != value or value == float("inf"):
        raise MemoryPlanError(f"{what} must be a positive number, got {text!r}.")
    return int(round(value))
