"""Lightning accelerators. ``register_accelerators`` puts lightspeed's into Lightning's AcceleratorRegistry.

Importing this package does not import torch_xla; the XLA accelerator only loads it when a Trainer uses it.
"""

from __future__ import annotations

from lightspeed._lazy import lazy_getattr

__all__ = ["XLAAccelerator", "register_accelerators"]


def register_accelerators() -> None:
    """Register ``accelerator="xla"`` (replacing any earlier entry) and route it to lightspeed's XLA strategy and
    precision; stop Lightning's TPU probe from calling the TPU metadata server off TPUs. Idempotent."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    from lightspeed.plugins.accelerators.xla import XLAAccelerator, quiet_lightning_tpu_probe
    from lightspeed.plugins.accelerators.xla_routing import install_xla_routing

    XLAAccelerator.register_accelerators(AcceleratorRegistry)  # override=True: replaces an earlier "xla" entry
    install_xla_routing()
    quiet_lightning_tpu_probe()


__getattr__ = lazy_getattr(__name__, {"XLAAccelerator": "lightspeed.plugins.accelerators.xla"})
