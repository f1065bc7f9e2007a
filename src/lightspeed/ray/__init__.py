"""Ray Train front end (``pip install lightspeed[ray]``): lightspeed's ZeRO strategy for a Lightning Trainer built
inside a ``ray.train.torch.TorchTrainer`` training function, as Ray's Lightning guide writes it.

Ray Train is the scheduler (workers, placement, restarts after a failure, checkpoint storage); lightspeed trains in
the workers. This package is Ray glue over the Trainer front end (:mod:`lightspeed.strategies`), which knows nothing
of Ray; nothing else in lightspeed imports it.
"""

from __future__ import annotations

try:
    import ray.train  # noqa: F401
except ImportError as missing:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "lightspeed.ray needs Ray Train: pip install 'lightspeed[ray]' (or pip install 'ray[train]')."
    ) from missing

from lightspeed.ray.trainer import RayZeroStrategy

__all__ = ["RayZeroStrategy"]
