"""Everything ``import lightspeed`` adds to Lightning's registries, in one place.

* strategies: ``zero1`` ... ``zero3_nvme`` (:data:`~lightspeed.core.zero.config.ZERO_PRESETS`), ``zero_auto``,
  ``ddp_exact``, ``xla_exact`` and ``single_xla_exact``;
* the same ZeRO names, ``zero_auto`` and ``ddp_exact`` in Lightning Fabric's registry
  (:func:`lightspeed.fabric.register_fabric_strategies`);
* the accelerator: ``accelerator="xla"`` becomes lightspeed's :class:`~lightspeed.plugins.XLAAccelerator`;
* the precision plugin: an ``accelerator="xla"`` run gets lightspeed's :class:`~lightspeed.plugins.XLAPrecision`
  and an XLA strategy (:mod:`lightspeed.strategies.xla_routing`), and Lightning's TPU probe no longer calls the
  TPU metadata server off TPUs.

Registering again replaces lightspeed's own entries and changes nothing else (idempotent). torch_xla and DeepSpeed
are not imported.
"""

from __future__ import annotations

from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry

from lightspeed.core.zero.config import ZERO_PRESETS
from lightspeed.core.zero.runtime import use_prebuilt_deepspeed_ops
from lightspeed.fabric.registration import register_fabric_strategies
from lightspeed.plugins.accelerators.xla import XLAAccelerator, quiet_lightning_tpu_probe
from lightspeed.strategies.ddp_exact import DDPExactStrategy
from lightspeed.strategies.xla import SingleDeviceXLAExactStrategy, XLAExactStrategy
from lightspeed.strategies.xla_routing import install_xla_routing
from lightspeed.strategies.zero import ZeroStrategy
from lightspeed.strategies.zero_auto import ZeroAutoStrategy

__all__ = ["register_all"]


def register_all() -> None:
    """Register lightspeed's strategies (Trainer and Fabric), accelerator and precision routing with Lightning
    (idempotent)."""
    use_prebuilt_deepspeed_ops()  # before DeepSpeed builds anything: the venv's prebuilt ops, not a rebuild
    for name, preset in ZERO_PRESETS.items():
        StrategyRegistry.register(
            name, ZeroStrategy, description=preset.description, override=True, **preset.init_params()
        )
    StrategyRegistry.register(
        "zero_auto",
        ZeroAutoStrategy,
        description="ZeRO with the fastest stage/offload that fits the model in this machine's memory",
        override=True,
    )
    StrategyRegistry.register(
        "ddp_exact",
        DDPExactStrategy,
        description="DDP with exact gradient accumulation (short last window, item weighting, no_sync)",
        override=True,
        start_method="popen",
    )
    StrategyRegistry.register(
        "xla_exact",
        XLAExactStrategy,
        description="XLA on all PJRT devices with exact gradient accumulation and casting XLAPrecision",
        override=True,
    )
    StrategyRegistry.register(
        "single_xla_exact",
        SingleDeviceXLAExactStrategy,
        description="One XLA device with exact gradient accumulation and casting XLAPrecision",
        override=True,
    )
    register_fabric_strategies()
    AcceleratorRegistry.register("xla", XLAAccelerator, description=XLAAccelerator.__name__, override=True)
    install_xla_routing()
    quiet_lightning_tpu_probe()
