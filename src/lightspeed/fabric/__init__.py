"""lightspeed for Lightning Fabric: the same strategy names as for the Trainer (``Fabric(strategy="zero3")``, on CUDA
and on the CPU), exact gradient accumulation in hand-written loops (:func:`accumulate`), and with them
``lightspeed.gather_for_metrics`` and ``lightspeed export`` for what ``fabric.save`` wrote.

``import lightspeed`` registers the names (:func:`register_fabric_strategies`).
"""

from lightspeed.fabric.accumulate import AccumulationStep, accumulate
from lightspeed.fabric.registration import register_fabric_strategies
from lightspeed.fabric.strategies import DDPExactFabricStrategy, ZeroAutoFabricStrategy, ZeroFabricStrategy

__all__ = [
    "AccumulationStep",
    "DDPExactFabricStrategy",
    "ZeroAutoFabricStrategy",
    "ZeroFabricStrategy",
    "accumulate",
    "register_fabric_strategies",
]
