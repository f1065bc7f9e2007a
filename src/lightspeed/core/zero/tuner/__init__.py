"""``zero_auto``'s measured mode: among the ZeRO options the memory planner says fit, run a few real steps of each
in the run's own processes, pick the fastest, and remember the decision (:mod:`.trials`, :mod:`.cache`,
:mod:`.decision`, :mod:`.copies`)."""

from lightspeed.core.zero.tuner.batches import first_batches, rebatched
from lightspeed.core.zero.tuner.cache import DEFAULT_CACHE_PATH, TuningCache, TuningKey
from lightspeed.core.zero.tuner.copies import copy_module_and_optimizer
from lightspeed.core.zero.tuner.decision import (
    TrialParts,
    TuneRequest,
    TuneResult,
    candidates_from_plan,
    micro_batch_choices,
    tune,
    zero_auto_requests,
)
from lightspeed.core.zero.tuner.trials import (
    BUCKET_VARIANTS,
    Candidate,
    Trial,
    TrialSetup,
    deepspeed_engine_builder,
    format_trials,
)

__all__ = [
    "BUCKET_VARIANTS",
    "DEFAULT_CACHE_PATH",
    "Candidate",
    "Trial",
    "TrialParts",
    "TrialSetup",
    "TuneRequest",
    "zero_auto_requests",
    "TuneResult",
    "TuningCache",
    "TuningKey",
    "candidates_from_plan",
    "copy_module_and_optimizer",
    "deepspeed_engine_builder",
    "first_batches",
    "format_trials",
    "micro_batch_choices",
    "rebatched",
    "tune",
]
