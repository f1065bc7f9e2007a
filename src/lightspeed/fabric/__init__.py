"""lightspeed for Lightning Fabric: the same strategy names as for the Trainer (``Fabric(strategy="zero3")``, on CUDA
and on the CPU), exact gradient accumulation in hand-written loops (:func:`accumulate`), resuming from the newest
complete checkpoint (:func:`last_checkpoint`), and with them ``lightspeed.gather_for_metrics`` and ``lightspeed export``
for what ``fabric.save`` wrote.

The modules mirror :mod:`lightspeed.strategies` file for file (``zero``, ``zero_auto``, ``ddp_exact``,
``exact_accumulation``, ``process_group``, ``several_models``); both call the same core. ``import lightspeed``
registers the names (:func:`register_fabric_strategies`).
"""

from lightspeed.fabric.config_optimizer import config_optimizer
from lightspeed.fabric.ddp_exact import DDPExactFabricStrategy
from lightspeed.fabric.exact_accumulation import AccumulationStep, accumulate
from lightspeed.fabric.last_checkpoint import last_checkpoint
from lightspeed.fabric.registration import register_fabric_strategies
from lightspeed.fabric.several_models import model_options
from lightspeed.fabric.zero import ZeroFabricStrategy
from lightspeed.fabric.zero_auto import ZeroAutoFabricStrategy

__all__ = [
    "AccumulationStep",
    "DDPExactFabricStrategy",
    "ZeroAutoFabricStrategy",
    "ZeroFabricStrategy",
    "accumulate",
    "config_optimizer",
    "last_checkpoint",
    "model_options",
    "register_fabric_strategies",
]
