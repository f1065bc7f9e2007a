"""lightspeed: DeepSpeed ZeRO, XLA, exact accumulation, exact distributed metrics and safetensors export,
packaged as Lightning strategies, plugins and callbacks.

``import lightspeed`` registers the strategy names (``zero1`` ... ``zero3_nvme``, ``zero_auto``, ``ddp_exact``,
``xla_exact``) with the Trainer and Fabric, ``accelerator="xla"`` and the XLA precision routing with Lightning
(:mod:`lightspeed.registry`).
DeepSpeed and torch_xla are imported only when a run uses them.

Public: the subpackages ``strategies``, ``plugins``, ``callbacks``, ``fabric``, ``export``, ``xla`` (padding to fixed
shapes, the recompilation alarm) and ``errors`` (every exception a user can meet), the gather functions below
(``exact_metrics``: the exact metrics of a whole evaluation loop without the Trainer), and
``load_pretrained`` (pretrained weights into a model, straight into its ZeRO-3 partitions),
``gathered_for_generation`` (a ZeRO-3 model gathered once for a whole generation) and ``gathered_for_evaluation`` (a
ZeRO-3 model gathered once for an evaluation whose ranks run different numbers of batches).
``lightspeed.core`` is internal.

The exceptions are public in :mod:`lightspeed.errors` only: ``lightspeed.GatherError`` still works, deprecated
(a ``FutureWarning``), for ``lightspeed.errors.GatherError``.
"""

import typing as _typing

from lightspeed import callbacks, errors, export, fabric, plugins, strategies, xla
from lightspeed._version import __version__
from lightspeed.core.common import deprecation as _deprecation
from lightspeed.core.gather import (
    exact_metrics,
    gather_for_metrics,
    gather_object,
    pad_across_processes,
    shard_iterable,
    track,
)
from lightspeed.core.zero.evaluation import gathered_for_evaluation
from lightspeed.core.zero.generation import gathered_for_generation
from lightspeed.core.zero.pretrained import load_pretrained
from lightspeed.registry import register_all

register_all()

__all__ = [
    "__version__",
    "callbacks",
    "errors",
    "exact_metrics",
    "export",
    "fabric",
    "gather_for_metrics",
    "gather_object",
    "gathered_for_evaluation",
    "gathered_for_generation",
    "load_pretrained",
    "pad_across_processes",
    "plugins",
    "shard_iterable",
    "strategies",
    "track",
    "xla",
]

#: names once public here, still reachable with a FutureWarning: old name -> (new spelling, object)
_MOVED = {"GatherError": ("lightspeed.errors.GatherError", errors.GatherError)}

if not _typing.TYPE_CHECKING:  # type checkers report the old names as missing; at run time they still work

    def __getattr__(name: str) -> object:
        return _deprecation.moved_attribute(__name__, name, _MOVED)
