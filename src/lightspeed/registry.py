"""Everything ``import lightspeed`` adds to Lightning's registries, in one place.

* strategies: ``zero1`` ... ``zero3_nvme`` (:data:`~lightspeed.core.zero.config.ZERO_PRESETS`), ``zero_auto``,
  ``ddp_exact``, ``xla_exact`` and ``single_xla_exact``
  (:func:`lightspeed.strategies.registration.register_trainer_strategies`);
* the same ZeRO names, ``zero_auto`` and ``ddp_exact`` in Lightning Fabric's registry
  (:func:`lightspeed.fabric.registration.register_fabric_strategies`);
* the accelerator: ``accelerator="xla"`` becomes lightspeed's :class:`~lightspeed.plugins.XLAAccelerator`;
* the exit clean-up: a gloo default process group, lightspeed's or another's, is destroyed while the interpreter is
  still whole (:func:`~lightspeed.core.reliability.process_group.release_other_gloo_group`);
* the precision plugin: an ``accelerator="xla"`` run gets lightspeed's :class:`~lightspeed.plugins.XLAPrecision`
  and an XLA strategy (:mod:`lightspeed.strategies.xla_routing`), and Lightning's TPU probe no longer calls the
  TPU metadata server off TPUs;
* the log switch: ``LIGHTSPEED_LOG_LEVEL`` sets the level of the ``lightspeed`` logger
  (:func:`~lightspeed.core.common.logs.configure_from_environment`).

Registering again replaces lightspeed's own entries and changes nothing else (idempotent). torch_xla and DeepSpeed
are not imported.
"""

from __future__ import annotations

from lightning.pytorch.accelerators import AcceleratorRegistry

from lightspeed.core.common.logs import configure_from_environment
from lightspeed.core.reliability.process_group import register_exit_cleanup
from lightspeed.core.zero.runtime import use_prebuilt_deepspeed_ops
from lightspeed.fabric.registration import register_fabric_strategies
from lightspeed.plugins.accelerators.xla import XLAAccelerator, quiet_lightning_tpu_probe
from lightspeed.strategies.registration import register_trainer_strategies
from lightspeed.strategies.xla_routing import install_xla_routing

__all__ = ["register_all"]


def register_all() -> None:
    """Register lightspeed's strategies (Trainer and Fabric), accelerator and precision routing with Lightning
    (idempotent)."""
    configure_from_environment()  # LIGHTSPEED_LOG_LEVEL, checked before anything else
    use_prebuilt_deepspeed_ops()  # before DeepSpeed builds anything: the venv's prebuilt ops, not a rebuild
    register_exit_cleanup()  # gloo groups (lightspeed's or Lightning's ddp beside a lightspeed callback) end cleanly
    register_trainer_strategies()
    register_fabric_strategies()
    AcceleratorRegistry.register("xla", XLAAccelerator, description=XLAAccelerator.__name__, override=True)
    install_xla_routing()
    quiet_lightning_tpu_probe()
