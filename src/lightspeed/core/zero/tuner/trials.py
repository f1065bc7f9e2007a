"""Measure the ZeRO options that fit: a few real training steps of each, in the processes of the run.

Each candidate (a ZeRO option, a bucket-size variant and a micro-batch size) trains a fresh copy of the model and its
optimizer for ``warmup + steps`` optimizer steps on the run's own first samples, through a DeepSpeed engine built with
the candidate's resolved config; an optimizer step is the run's global batch (``micro-batch x accumulation``, so a
smaller micro-batch accumulates more of them and every candidate trains the same samples per step). The measured
steps give samples/s (the slowest rank's time, so every rank agrees) and the peak memory. The run itself is
untouched: the copies are dropped, and the random number generators are restored afterwards, so the tuned run trains
exactly as an untuned run with the chosen config would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from lightspeed.core.common.batch import count_samples
from lightspeed.core.common.sizes import format_size
from lightspeed.core.zero.auto_choice import ZeroAutoRequest, zero_auto_config
from lightspeed.core.zero.config import ZeroTuning
from lightspeed.core.zero.planner import ZeroOption
from lightspeed.core.zero.release import release_engine

__all__ = [
    "BUCKET_VARIANTS",
    "Candidate",
    "Trial",
    "TrialSetup",
    "deepspeed_engine_builder",
    "format_trials",
    "preserved_random_state",
    "run_trials",
]

#: bucket-size variants tried with ``tune_buckets=True``: lightspeed's sizes from the hidden size, DeepSpeed's own
BUCKET_VARIANTS: dict[str, dict[str, Any]] = {
    "auto": {},
    "deepspeed": {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000},
}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration to measure: a ZeRO option, a bucket-size variant, and a micro-batch size with the
    accumulation that keeps the run's batch per optimizer step (``None``: the run's own)."""

    option: ZeroOption
    buckets: str = "auto"
    micro_batch: int | None = None
    accumulation: int | None = None

    @property
    def name(self) -> str:
        name = self.option.name if self.buckets == "auto" else f"{self.option.name}+{self.buckets}_buckets"
        return name if self.micro_batch is None else f"{name}+micro_batch_{self.micro_batch}"

    def with_batching(self, resolved: dict[str, Any], world_size: int) -> dict[str, Any]:
        """A resolved config with this candidate's micro-batch size and accumulation (the same global batch)."""
        if self.micro_batch is None or self.accumulation is None:
            return resolved
        return {
            **resolved,
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.accumulation,
            "train_batch_size": self.micro_batch * self.accumulation * world_size,
        }

    def tuning(self, base: ZeroTuning) -> ZeroTuning:
        """``base`` with this candidate's bucket sizes."""
        return dataclasses.replace(base, **BUCKET_VARIANTS[self.buckets])

    def config(self, request: ZeroAutoRequest) -> dict[str, Any]:
        """This candidate's DeepSpeed config (``"auto"`` values unresolved) under zero_auto's ``request``."""
        tuning = self.tuning(request.tuning)
        return zero_auto_config(self.option, request.user_config, tuning, request.nvme_path)


@dataclasses.dataclass(frozen=True)
class Trial:
    """What one candidate measured: samples/s (None when it failed), peak memory in bytes, or the error."""

    candidate: Candidate
    samples_per_second: float | None
    peak_memory: int | None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class TrialSetup:
    """What the front end provides for the trials.

    ``copy_model``: a fresh copy of the model and its optimizer; ``config_for``: the resolved DeepSpeed config of a
    candidate; ``build_engine``: ``(config, model, optimizer) -> engine``; ``loss``: ``(model, batch, index) ->
    loss`` for one micro-batch; ``take_batches(n, micro_batch)``: the run's first ``n`` micro-batches on this rank,
    of ``micro_batch`` samples each (``None``: as the run's loader batches them; taken while the random number
    generators are preserved, so a shuffling loader is not advanced); ``device``: the training device (its peak memory
    is measured); ``accumulation``: the run's micro-batches per optimizer step."""

    copy_model: Callable[[], tuple[torch.nn.Module, Any]]
    config_for: Callable[[Candidate], dict[str, Any]]
    build_engine: Callable[[dict[str, Any], torch.nn.Module, Any], Any]
    loss: Callable[[torch.nn.Module, Any, int], torch.Tensor]
    take_batches: Callable[[int, int | None], list[Any]]
    device: torch.device
    accumulation: int = 1


def deepspeed_engine_builder(
    device_index: int | None, local_rank: int
) -> Callable[[dict[str, Any], torch.nn.Module, Any], Any]:
    """``TrialSetup.build_engine`` as the strategies build their engines: the optimizer prepared for the config
    (CPU Adam under optimizer offload), then ``deepspeed.initialize``."""
    from lightspeed.core.zero.engine import initialize_engine, prepare_optimizer

    def build(config: dict[str, Any], model: torch.nn.Module, optimizer: Any) -> Any:
        if optimizer is not None:
            optimizer, _ = prepare_optimizer(optimizer, None, config)
        engine, _, _ = initialize_engine(config, model, optimizer, None, device_index, local_rank)
        return engine

    return build


@contextlib.contextmanager
def preserved_random_state() -> Iterator[None]:
    """Restore Python's, NumPy's, torch's and CUDA's random number generators after the block."""
    python_state = random.getstate()
    torch_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        import numpy

        numpy_state: Any = numpy.random.get_state()
    except ImportError:
        numpy_state = None
    try:
        yield
    finally:
        random.setstate(python_state)
        torch.random.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        if numpy_state is not None:
            import numpy

            numpy.random.set_state(numpy_state)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):  # Linux: "5" resets VmHWM, the peak resident set size, to the current one
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")


def _peak(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _agreed(seconds: float, error: str | None) -> tuple[float, str | None]:
    """The slowest rank's ``seconds`` and the lowest failing rank's error (a collective: one object gather, which
    works on every backend), so that every rank computes the same samples/s and drops the same candidates."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return seconds, error
    reports: list[tuple[float, str | None] | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(reports, (seconds, error))
    received = [report for report in reports if report is not None]
    first = next((f"rank {rank}: {e}" for rank, (_, e) in enumerate(received) if e is not None), None)
    return max(s for s, _ in received), first


class _LossOf(torch.nn.Module):
    """The module a trial's engine wraps: its forward is the training loss of ``model``, so every step runs through
    the engine's forward (ZeRO-3 gathers parameters read outside their module only there, e.g. attention's
    ``out_proj.weight``; DeepSpeed's forward hooks and timers run as in a real run)."""

    def __init__(self, model: torch.nn.Module, loss: Callable[[torch.nn.Module, Any, int], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self._loss = loss

    def forward(self, batch: Any, index: int) -> torch.Tensor:
        return self._loss(self.model, batch, index)


def _micro_batches_per_step(candidate: Candidate, setup: TrialSetup) -> int:
    """Micro-batches per optimizer step: the candidate's accumulation, or the run's for its own micro-batch size."""
    return candidate.accumulation or setup.accumulation


def _measure(candidate: Candidate, setup: TrialSetup, batches: list[Any], steps: int, warmup: int) -> Trial:
    engine: Any = None
    error: str | None = None
    seconds = 0.0
    peak: int | None = None
    per_step = _micro_batches_per_step(candidate, setup)
    try:
        model, optimizer = setup.copy_model()
        engine = setup.build_engine(setup.config_for(candidate), _LossOf(model, setup.loss), optimizer)
        _reset_peak(setup.device)
        for index in range(per_step * (warmup + steps)):
            if index == per_step * warmup:
                if setup.device.type == "cuda":
                    torch.cuda.synchronize(setup.device)
                start = time.perf_counter()
            batch = batches[index % len(batches)]
            engine.backward(engine(batch, index))  # through the engine's forward, as a real run goes
            engine.step()  # DeepSpeed steps the optimizer at each accumulation boundary
        if setup.device.type == "cuda":
            torch.cuda.synchronize(setup.device)
        seconds = time.perf_counter() - start
        peak = _peak(setup.device)
    except Exception as err:  # noqa: BLE001 - a candidate that cannot train is dropped; every rank learns why
        error = f"{type(err).__name__}: {err}"
    finally:
        if engine is not None:  # a trial's engine is freed before the next trial builds one
            with contextlib.suppress(Exception):
                release_engine(engine)
        engine = None
        gc.collect()
    slowest, error = _agreed(seconds, error)
    if error is not None:
        return Trial(candidate, None, None, error)
    measured = range(per_step * warmup, per_step * (warmup + steps))
    samples = sum(count_samples(batches[index % len(batches)]) or 1 for index in measured)
    return Trial(candidate, samples / slowest if slowest > 0 else float("inf"), peak)


def run_trials(candidates: Sequence[Candidate], setup: TrialSetup, *, steps: int = 3, warmup: int = 1) -> list[Trial]:
    """Measure every candidate for ``warmup + steps`` optimizer steps (a collective: every rank runs the same
    candidates in the same order); the random number generators are as before afterwards.

    The candidates are measured twice, in order and then in reverse order, and each keeps its better pass: the first
    engines of a process pay one-time costs (allocator growth, first use of DeepSpeed's ops) that made the first
    candidate, the planner's choice, look up to 1.5 times slower than equal options in ``bench/tune_speed.py``."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"tune_steps must be >= 1 and the warm-up >= 0, got steps={steps}, warmup={warmup}.")
    with preserved_random_state():
        taken: dict[int | None, list[Any]] = {}  # the same samples for every candidate of one micro-batch size
        for candidate in candidates:
            if candidate.micro_batch not in taken:
                count = _micro_batches_per_step(candidate, setup) * (warmup + steps)
                taken[candidate.micro_batch] = setup.take_batches(count, candidate.micro_batch)
                if not taken[candidate.micro_batch]:
                    raise ValueError("The tuner needs at least one training batch, but the training data yielded none.")

        def measure(candidate: Candidate) -> Trial:
            return _measure(candidate, setup, taken[candidate.micro_batch], steps, warmup)

        first = [measure(candidate) for candidate in candidates]
        if len(candidates) < 2:
            return first
        second = [measure(candidate) for candidate in reversed(candidates)][::-1]
        return [_better(a, b) for a, b in zip(first, second, strict=True)]


def _better(a: Trial, b: Trial) -> Trial:
    """One candidate's two passes as one trial: the faster, with the higher peak memory; failed if either failed."""
    if a.samples_per_second is None or b.samples_per_second is None:
        return a if a.samples_per_second is None else b
    faster = a if a.samples_per_second >= b.samples_per_second else b
    peaks = [peak for peak in (a.peak_memory, b.peak_memory) if peak is not None]
    return dataclasses.replace(faster, peak_memory=max(peaks) if peaks else None)


def format_trials(trials: Sequence[Trial], chosen: Candidate | None) -> str:
    """The measured table: samples/s and peak memory per candidate, the chosen one marked."""
    rows = [("candidate", "samples/s per rank", "peak memory", "")]
    for trial in trials:
        speed = f"{trial.samples_per_second:.1f}" if trial.samples_per_second is not None else "failed"
        peak = format_size(trial.peak_memory) if trial.peak_memory is not None else "-"
        note = "<- chosen" if chosen is not None and trial.candidate == chosen else (trial.error or "")
        rows.append((trial.candidate.name, speed, peak, note))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) if i < 3 else cell for i, cell in enumerate(row)).rstrip() for row in rows
    )
