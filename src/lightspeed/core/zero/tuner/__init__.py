"""``zero_auto``'s measured mode: among the ZeRO options the memory planner says fit, run a few real steps of each
in the run's own processes, pick the fastest, and remember the decision (:mod:`.trials`, :mod:`.cache`,
:mod:`.decision`, :mod:`.copies`)."""

from lightspeed.core.zero.tuner.batches import first_batches, rebatched
from lightspeed.core.zero.tuner.cache import DEFAULT_CACHE_PATH
from lightspeed.core.zero.tuner.copies import copy_module_and_optimizer
from lightspeed.core.zero.tuner.decision import (
    TrialParts,
    TuneRequest,
    micro_batch_choices,
    zero_auto_arguments,
    zero_auto_requests,
)

# what the front ends, the CLI and the tests take from the package; the rest is imported from its module
__all__ = [
    "DEFAULT_CACHE_PATH",
    "TrialParts",
    "TuneRequest",
    "copy_module_and_optimizer",
    "first_batches",
    "micro_batch_choices",
    "rebatched",
    "zero_auto_arguments",
    "zero_auto_requests",
]
