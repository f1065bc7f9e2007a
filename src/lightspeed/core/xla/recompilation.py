"""The recompilation alarm: after the first steps of a run, a step that makes torch_xla compile again because the
batch's input shapes or dtypes changed is reported once, with what changed and what to do.

torch_xla traces every step lazily and compiles the traced graph when it is executed (at ``torch_xla.sync()``,
which Lightning's XLA plugins call after every optimizer step); an unseen graph, e.g. one for a new sequence
length, is compiled again, which takes far longer than the step. torch_xla counts its compilations in the
``CompileTime`` metric and its graph executions in ``ExecuteTime`` (:mod:`torch_xla.debug.metrics`).

:class:`RecompilationAlarm` reads both counts at the start of every step (:meth:`RecompilationAlarm.observe`,
nothing is synced or executed for it). A step's graph is compiled by the next execution, at the latest at the
start of the next step; so compilations counted since the previous step started belong to the steps since the last
execution (several micro-batches of an accumulation window on one device). If one of them, past the warm-up, has
other input shapes or dtypes than the step before it, the alarm warns (once) naming the changed tensors.

torch_xla is imported only when the counts are read.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightspeed.core.common.checks import require_whole_number
from lightspeed.core.xla.batch_tree import format_path, tensor_leaves

__all__ = [
    "DEFAULT_WARMUP_STEPS",
    "BatchSignature",
    "RecompilationAlarm",
    "XLARecompilationWarning",
    "batch_signature",
    "check_warmup_steps",
    "describe_changes",
    "xla_compile_and_execute_counts",
]

#: steps whose compilations are expected (the first step's graphs, the first optimizer step's)
DEFAULT_WARMUP_STEPS = 2

#: changed tensors listed in the message at most; the rest are counted
_MAX_LISTED = 4

#: path -> (shape, dtype) of every tensor of a batch
BatchSignature = dict[str, tuple[tuple[int, ...], torch.dtype]]


class XLARecompilationWarning(UserWarning):
    """A step after the warm-up made torch_xla compile again because the batch's shapes or dtypes changed.

    Silence it with ``warnings.filterwarnings("ignore", category=XLARecompilationWarning)``, or turn the alarm off
    (``recompilation_alarm=False`` on the XLA strategies).
    """


def xla_compile_and_execute_counts() -> tuple[int, int]:
    """How many graphs torch_xla has compiled and executed in this process (``CompileTime`` and ``ExecuteTime``
    sample counts of :mod:`torch_xla.debug.metrics`; 0 before the first)."""
    import torch_xla.debug.metrics as metrics

    def count(name: str) -> int:
        data = metrics.metric_data(name)
        return 0 if data is None else int(data[0])

    return count("CompileTime"), count("ExecuteTime")


def batch_signature(batch: Any) -> BatchSignature:
    """Shape and dtype of every tensor of ``batch`` (read from the tensors' metadata: nothing is synced)."""
    return {format_path(path): (tuple(tensor.shape), tensor.dtype) for path, tensor in tensor_leaves(batch)}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def describe_changes(before: BatchSignature, after: BatchSignature) -> list[str]:
    """One line per tensor whose shape or dtype differs (or that appeared or disappeared), e.g.
    ``batch['input_ids'] (8, 128) -> (8, 97)``, ``batch['x'] float32 -> bfloat16``."""
    changes = []
    for name in [*before, *(key for key in after if key not in before)]:
        old, new = before.get(name), after.get(name)
        if old == new:
            continue
        if old is None or new is None:
            old_text = "absent" if old is None else f"{old[0]} {_dtype_name(old[1])}"
            new_text = "absent" if new is None else f"{new[0]} {_dtype_name(new[1])}"
        elif old[1] == new[1]:
            old_text, new_text = str(old[0]), str(new[0])
        elif old[0] == new[0]:
            old_text, new_text = _dtype_name(old[1]), _dtype_name(new[1])
        else:
            old_text, new_text = f"{old[0]} {_dtype_name(old[1])}", f"{new[0]} {_dtype_name(new[1])}"
        changes.append(f"{name} {old_text} -> {new_text}")
    return changes


def _only_batch_size_changed(before: BatchSignature, after: BatchSignature) -> bool:
    """Same tensors and dtypes, and only dimension 0 of some shapes differs (the short last batch of an epoch)."""
    if before.keys() != after.keys():
        return False
    for name, (shape, dtype) in before.items():
        new_shape, new_dtype = after[name]
        if dtype != new_dtype or len(shape) != len(new_shape) or shape[1:] != new_shape[1:]:
            return False
    return True


def _changed_kinds(before: BatchSignature, after: BatchSignature) -> tuple[bool, bool]:
    """Whether shapes (a tensor's, or which tensors there are) and whether dtypes changed."""
    common = [name for name in before if name in after]
    shapes = before.keys() != after.keys() or any(before[name][0] != after[name][0] for name in common)
    dtypes = any(before[name][1] != after[name][1] for name in common)
    return shapes, dtypes


def _advice(before: BatchSignature, after: BatchSignature) -> str:
    shapes, dtypes = _changed_kinds(before, after)
    parts = []
    if shapes and _only_batch_size_changed(before, after):
        parts.append(
            "Only the batch size changed: the last batch of an epoch is smaller unless the DataLoader drops it"
            " (DataLoader(..., drop_last=True))."
        )
    elif shapes:
        parts.append(
            "Pad every batch to one of a few fixed shapes: lightspeed.xla.pad_to_bucket(batch, buckets=(128, 256,"
            " 512)) on the collated batch, or DataLoader(..., collate_fn=lightspeed.xla.bucket_collate((128, 256,"
            " 512)))."
        )
    if dtypes:
        parts.append("Give every batch the same dtypes.")
    return " ".join(parts)


def check_warmup_steps(warmup_steps: int) -> int:
    """``warmup_steps``, checked to be a whole number >= 0: the first steps, whose compilations are expected."""
    return require_whole_number(
        warmup_steps,
        0,
        f"recompilation warm-up steps must be a whole number >= 0 (the first steps, whose compilations are"
        f" expected), got {warmup_steps!r}.",
    )


def _torch_xla_needed() -> None:
    if importlib.util.find_spec("torch_xla") is None:
        raise ModuleNotFoundError(
            "RecompilationAlarm reads torch_xla's compile metrics, but torch_xla is not installed. Use it in a run on"
            " an XLA device (pip install torch_xla matching your torch version)."
        )


@dataclass
class _Step:
    index: int
    signature: BatchSignature
    previous: BatchSignature | None


@dataclass
class RecompilationAlarm:
    """Warns once when a step after the warm-up makes torch_xla compile again because the batch's input shapes or
    dtypes changed; the XLA strategies run one per fit. In a Fabric loop, or any loop of your own::

        alarm = lightspeed.xla.RecompilationAlarm()
        for batch in loader:
            alarm.observe(batch)          # first thing in the step, with the batch the step runs on
            ...                           # forward, backward, optimizer step (torch_xla.sync())
        alarm.close()                     # counts the last step's compilations

    Args:
        warmup_steps: the first steps, whose compilations are expected and never reported.
        warn: called with the message (default: ``warnings.warn`` with :class:`XLARecompilationWarning`).
        counts: returns the (compiled, executed) graph counts so far (default: torch_xla's metrics).

    After a run, :attr:`recompiled_steps` lists every step past the warm-up that compiled again with changed inputs
    (the warning names the first), and :attr:`message` holds the warning's text.
    """

    warmup_steps: int = DEFAULT_WARMUP_STEPS
    warn: Callable[[str], Any] | None = None
    counts: Callable[[], tuple[int, int]] | None = None
    recompiled_steps: list[int] = field(default_factory=list, init=False)
    message: str | None = field(default=None, init=False)
    _steps: int = field(default=0, init=False, repr=False)
    _baseline: tuple[int, int] | None = field(default=None, init=False, repr=False)
    _pending: list[_Step] = field(default_factory=list, init=False, repr=False)
    _previous: BatchSignature | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_warmup_steps(self.warmup_steps)
        if self.counts is None:
            _torch_xla_needed()

    @property
    def steps(self) -> int:
        """How many steps were observed."""
        return self._steps

    def observe(self, batch: Any) -> None:
        """Call at the start of every step with its batch: reads the compile count (attributing what the previous
        steps compiled) and records the batch's shapes and dtypes."""
        self._check()
        signature = batch_signature(batch)
        self._pending.append(_Step(self._steps, signature, self._previous))
        self._previous = signature
        self._steps += 1

    def pause(self) -> None:
        """Before work that is not a training step (a validation loop): attribute the compilations so far, then
        ignore everything until the next :meth:`observe`."""
        self._check()
        self._baseline = None
        self._pending.clear()

    def close(self) -> None:
        """At the end of the run: attribute the last steps' compilations."""
        self.pause()

    def _read(self) -> tuple[int, int]:
        counts = self.counts or xla_compile_and_execute_counts
        return counts()

    def _check(self) -> None:
        compiled, executed = now = self._read()
        if self._baseline is None:
            self._baseline = now
            self._pending.clear()
            return
        new_compiles, new_executions = compiled - self._baseline[0], executed - self._baseline[1]
        self._baseline = now
        if new_compiles < 0 or new_executions < 0:  # torch_xla's metrics were cleared
            self._pending.clear()
            return
        if new_compiles > 0:
            self._on_compile(new_compiles, compiled)
        if new_compiles > 0 or new_executions > 0:
            self._pending.clear()  # every step so far has run: later compilations are later steps'

    def _on_compile(self, new_compiles: int, total: int) -> None:
        for step in self._pending:
            if step.index < self.warmup_steps or step.previous is None:
                continue
            changes = describe_changes(step.previous, step.signature)
            if changes:
                self.recompiled_steps.append(step.index)
                if self.message is None:
                    self.message = self._message(step, changes, new_compiles, total)
                    (self.warn or _warn)(self.message)
                return

    def _message(self, step: _Step, changes: list[str], new_compiles: int, total: int) -> str:
        assert step.previous is not None
        shapes, dtypes = _changed_kinds(step.previous, step.signature)
        what = "shapes and dtypes" if shapes and dtypes else "dtypes" if dtypes else "shapes"
        listed = "; ".join(changes[:_MAX_LISTED])
        if len(changes) > _MAX_LISTED:
            listed += f"; and {len(changes) - _MAX_LISTED} more"
        graphs = "graph" if new_compiles == 1 else "graphs"
        return (
            f"torch_xla compiled again after the warm-up: step {step.index} (counted from 0; the first"
            f" {self.warmup_steps} are warm-up) has other input {what} than the step before: {listed}."
            f" It compiled {new_compiles} new {graphs}, {total} in this process so far (the CompileTime count of"
            f" torch_xla.debug.metrics): every new input shape or dtype compiles again, which stalls training."
            f" {_advice(step.previous, step.signature)} This warning is shown once."
        )


def _warn(message: str) -> None:
    warnings.warn(message, XLARecompilationWarning, stacklevel=4)
