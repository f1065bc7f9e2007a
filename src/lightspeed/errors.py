"""Every exception lightspeed raises on purpose, importable from one place, under one base class:

.. code-block:: python

    from lightspeed.errors import LightspeedError, CollectiveTimeoutError

    try:
        trainer.fit(model, datamodule, ckpt_path="last")
    except CollectiveTimeoutError as hang:  # names the collective and the ranks that stopped answering or left
        ...

Each also derives from the built-in exception it always was (``ValueError``, ``RuntimeError`` or ``TypeError``).
"""

from lightspeed.core.errors import (
    CallSiteMismatch,
    CheckpointError,
    CollectiveTimeoutError,
    CudaInitializedError,
    DeepSpeedConfigError,
    ExportError,
    GatherError,
    IncompleteCheckpointError,
    LightspeedError,
    MemoryPlanError,
    RankLostError,
    StepOutputError,
    UnevenEvaluationError,
    UnsupportedOffloadOptimizerError,
    WorldSizeMismatchError,
)

__all__ = [
    "CallSiteMismatch",
    "CheckpointError",
    "CollectiveTimeoutError",
    "CudaInitializedError",
    "DeepSpeedConfigError",
    "ExportError",
    "GatherError",
    "IncompleteCheckpointError",
    "LightspeedError",
    "MemoryPlanError",
    "RankLostError",
    "StepOutputError",
    "UnevenEvaluationError",
    "UnsupportedOffloadOptimizerError",
    "WorldSizeMismatchError",
]
