"""lightspeed for Lightning Fabric: the same strategy names as for the Trainer (``Fabric(strategy="zero3")``, on CUDA
and on the CPU), exact gradient accumulation in hand-written loops (:func:`accumulate`), resuming from the newest
complete checkpoint (:func:`last_checkpoint`), and with them ``lightspeed.gather_for_metrics`` and ``lightspeed export``
for what ``fabric.save`` wrote.

The modules mirror :mod:`lightspeed.strategies` file for file (``zero``, ``zero_auto``, ``ddp_exact``,
``exact_accumulation``, ``process_group``, ``several_models``); both call the same core. ``import lightspeed``
registers the names (:func:`lightspeed.fabric.registration.register_fabric_strategies`).

Not public here any more, still reachable with a ``FutureWarning``: ``register_fabric_strategies`` (``import
lightspeed`` calls it) and ``AccumulationStep`` (the type of the steps :func:`accumulate` yields, in
:mod:`lightspeed.fabric.exact_accumulation`).
"""

from typing import TYPE_CHECKING

from lightspeed.core.common import deprecation as _deprecation
from lightspeed.fabric import exact_accumulation as _exact_accumulation
from lightspeed.fabric import registration as _registration
from lightspeed.fabric.config_optimizer import config_optimizer
from lightspeed.fabric.ddp_exact import DDPExactFabricStrategy
from lightspeed.fabric.exact_accumulation import accumulate
from lightspeed.fabric.last_checkpoint import last_checkpoint
from lightspeed.fabric.several_models import model_options
from lightspeed.fabric.zero import ZeroFabricStrategy
from lightspeed.fabric.zero_auto import ZeroAutoFabricStrategy

__all__ = [
    "DDPExactFabricStrategy",
    "ZeroAutoFabricStrategy",
    "ZeroFabricStrategy",
    "accumulate",
    "config_optimizer",
    "last_checkpoint",
    "model_options",
]

#: names once public here, still reachable with a FutureWarning: old name -> (new spelling, object)
_MOVED = {
    "AccumulationStep": ("lightspeed.fabric.exact_accumulation.AccumulationStep", _exact_accumulation.AccumulationStep),
    "register_fabric_strategies": _deprecation.moved_registration(_registration.register_fabric_strategies),
}

if not TYPE_CHECKING:  # type checkers report the old names as missing; at run time they still work
    __getattr__ = _deprecation.module_getattr(__name__, _MOVED)
