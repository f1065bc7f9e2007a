"""Every exception a lightspeed user can meet, under one base class :class:`LightspeedError`.

Each also derives from the built-in exception it was before (``ValueError`` for bad input, ``RuntimeError`` for a
run that cannot go on, ``TypeError`` for a wrong kind of object), so ``except ValueError`` keeps working. Every
message says what to change. The public import path is :mod:`lightspeed.errors`; this module sits at the bottom of
``core/`` so every feature package can raise them without importing another.

Renamed classes keep their old name as a deprecated alias (:data:`DEPRECATED_NAMES`): it is the same class, so
``except`` clauses written with it keep working, and reading it warns (``FutureWarning``) with the new name.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

__all__ = [
    "AdapterTargetError",
    "CallSiteMismatchError",
    "CheckpointError",
    "CollectiveTimeoutError",
    "CudaInitializedError",
    "DeepSpeedConfigError",
    "EngineReleasedError",
    "ExportError",
    "GatherError",
    "HostAddressError",
    "IncompleteCheckpointError",
    "LightspeedError",
    "MemoryPlanError",
    "ModelChangedError",
    "RankLostError",
    "SequenceParallelError",
    "StepOutputError",
    "UnevenEvaluationError",
    "UnsupportedOffloadOptimizerError",
    "WorldSizeMismatchError",
]


class LightspeedError(Exception):
    """Base class of every exception lightspeed raises on purpose; its message tells the user what to change."""


# ------------------------------------------------------------------------------------------------ configuration
class DeepSpeedConfigError(LightspeedError, ValueError):
    """A DeepSpeed config (or its combination with the Trainer's or Fabric's settings) cannot be used as given.

    When several problems were found, all of them are listed so the config can be fixed in one go.
    """


class MemoryPlanError(LightspeedError, ValueError):
    """Bad input to the memory planner (counts, sizes, factories) or a machine on which no ZeRO option fits."""


class UnsupportedOffloadOptimizerError(LightspeedError, TypeError):
    """The optimizer has no CPU implementation in DeepSpeed."""


# ------------------------------------------------------------------------------------------------ launching
class CudaInitializedError(LightspeedError, RuntimeError):
    """CUDA was initialised in the process that would fork the workers."""


class WorldSizeMismatchError(LightspeedError, ValueError):
    """``num_nodes``/``devices`` disagree with the processes an external launcher started."""


class HostAddressError(LightspeedError, RuntimeError):
    """A host of a job over several hosts would be reached at an address the others cannot reach (its hostname
    resolves to a loopback address); raised on every rank before the process group connects."""


class CollectiveTimeoutError(LightspeedError, RuntimeError):
    """A collective did not complete within the process group's timeout; names the collective and missing ranks."""


class RankLostError(CollectiveTimeoutError):
    """Another rank left the job (it failed, or its own collective timed out first) while this rank waited in a
    collective that can therefore never complete; names the collective and the rank. A
    :class:`CollectiveTimeoutError`, so one ``except`` serves both ways a job stops making progress."""


class ModelChangedError(LightspeedError, RuntimeError):
    """Evaluation after ``fit`` would run the training engine's weights, but the LightningModule now holds other
    parameters (``configure_model`` built the model again): the trained weights would not be the ones evaluated."""


class EngineReleasedError(LightspeedError, RuntimeError):
    """Evaluation would run a ZeRO engine that was released after its run ended, when another ZeRO run in this process
    built its own (DeepSpeed's engines are never freed otherwise)."""


class UnevenEvaluationError(LightspeedError, RuntimeError):
    """Ranks would run different numbers of evaluation batches on a ZeRO-3 model that cannot be gathered whole, so a
    rank that runs out of batches would leave the others waiting in their next forward pass."""


# ------------------------------------------------------------------------------------------------ checkpoints
class CheckpointError(LightspeedError, ValueError):
    """The checkpoint given is not a readable DeepSpeed ZeRO checkpoint (missing, truncated or mixed files), or does
    not fit the model it is loaded into."""


class IncompleteCheckpointError(CheckpointError, RuntimeError):
    """A checkpoint directory that was not completely written (an interrupted save) or changed after it was. A
    :class:`CheckpointError`, so one ``except`` serves every checkpoint that cannot be loaded; still the
    ``RuntimeError`` it always was."""


class AdapterTargetError(LightspeedError, ValueError):
    """A PEFT adapter names a target module the model does not have (peft would train fewer adapters silently)."""


class SequenceParallelError(LightspeedError, ValueError):
    """Sequence parallelism cannot split this run: the world, the model's attention or heads, or a batch do not
    divide over ``sequence_parallel_size`` ranks (or the run uses something sequence parallelism cannot keep exact)."""


class ExportError(LightspeedError, ValueError):
    """The export cannot be written where asked, or does not fit the module it is loaded into."""


# ------------------------------------------------------------------------------------------------ metrics
class GatherError(LightspeedError, RuntimeError):
    """Ranks disagree about a gather (structure, dtype, shape, call site), or a rank never arrived."""


class CallSiteMismatchError(GatherError):
    """The ranks met in different calls: e.g. one gathers a batch while another checks the end of its dataloader.
    (Called ``CallSiteMismatch`` before; that name is a deprecated alias.)"""


class StepOutputError(GatherError):
    """``validation_step`` / ``test_step`` did not return the predictions and targets ``GatherForMetrics`` reads."""


# ------------------------------------------------------------------------------------------------ old names
#: deprecated name -> the class's name now; the old name reaches the same class, with a FutureWarning
DEPRECATED_NAMES = {"CallSiteMismatch": "CallSiteMismatchError"}


if not TYPE_CHECKING:  # type checkers report the old names as missing; at run time they still work

    def __getattr__(name: str) -> type[LightspeedError]:
        """The deprecated names of :data:`DEPRECATED_NAMES` (``from lightspeed.errors import CallSiteMismatch``):
        the renamed class, after a ``FutureWarning`` naming its new name."""
        new = DEPRECATED_NAMES.get(name)
        if new is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        warnings.warn(
            f"lightspeed.errors.{name} is deprecated and will be removed; use lightspeed.errors.{new} instead (the "
            "same class, renamed).",
            FutureWarning,
            stacklevel=2,
        )
        cls: type[LightspeedError] = globals()[new]
        return cls
