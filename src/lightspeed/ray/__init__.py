"""Ray Train front end (``pip install lightspeed[ray]``): lightspeed's ZeRO strategies for a Lightning Trainer
(:class:`RayZeroStrategy`, as Ray's Lightning guide writes it) and a Fabric loop (:class:`RayZeroFabricStrategy`)
built inside a ``ray.train.torch.TorchTrainer`` training function.

Ray Train is the scheduler (workers, placement, restarts after a failure, checkpoint storage); lightspeed trains in
the workers. This package is Ray glue over the Trainer and Fabric front ends (:mod:`lightspeed.strategies`,
:mod:`lightspeed.fabric`), which know nothing of Ray; nothing else in lightspeed imports it.
"""

from __future__ import annotations

try:
    import ray.train  # noqa: F401
except ImportError as missing:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "lightspeed.ray needs Ray Train: pip install 'lightspeed[ray]' (or pip install 'ray[train]')."
    ) from missing

from lightspeed.ray.fabric import RayZeroFabricStrategy
from lightspeed.ray.trainer import RayZeroStrategy

__all__ = ["RayZeroFabricStrategy", "RayZeroStrategy"]
