"""Route ``Trainer(accelerator="xla")`` to lightspeed's XLA strategies and precision plugin.

Lightning's accelerator connector only picks its XLA strategies for the name ``"tpu"``, and builds its own
``XLAPrecision`` (which sets the deprecated ``XLA_USE_BF16``) for any XLA strategy. Two connector steps are
wrapped so that, when the accelerator is lightspeed's :class:`~lightspeed.plugins.accelerators.xla.XLAAccelerator`:

* ``strategy="auto"`` becomes ``single_xla_exact`` on one device and ``xla_exact`` on several;
* ``precision=...`` becomes :class:`lightspeed.plugins.XLAPrecision`, validated (mode, bfloat16 support of the
  device) while the Trainer is built, before anything trains.

Every other accelerator goes through Lightning's code unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.plugins.precision.xla import XLAPrecision as LightningXLAPrecision
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

from lightspeed.core.xla import runtime as xla_runtime
from lightspeed.plugins.accelerators.xla import XLAAccelerator
from lightspeed.plugins.precision.xla import XLAPrecision
from lightspeed.strategies.xla import SingleDeviceXLAExactStrategy, XLAExactStrategy

__all__ = ["install_xla_routing"]

_MARK = "_lightspeed_xla_routing"


def _uses_lightspeed_xla(connector: Any) -> bool:
    return isinstance(getattr(connector, "accelerator", None), XLAAccelerator)


def _wrap_choose_strategy(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def _choose_strategy(self: Any) -> Any:
        if not _uses_lightspeed_xla(self):
            return original(self)
        if len(self._parallel_devices) > 1:
            return XLAExactStrategy.strategy_name
        return SingleDeviceXLAExactStrategy(device=self._parallel_devices[0])

    setattr(_choose_strategy, _MARK, original)
    return _choose_strategy


def resolve_xla_precision(precision_flag: str, plugin: Any, device_type: str | None) -> Any:
    """The precision plugin for an XLA run: ``plugin`` if given, else ``XLAPrecision(precision_flag)``; checked."""
    if plugin is None:
        plugin = XLAPrecision(precision_flag)
    elif not isinstance(plugin, LightningXLAPrecision):
        raise TypeError(
            f"accelerator='xla' needs an XLA precision plugin, got {type(plugin).__name__}. Pass"
            " `plugins=[lightspeed.plugins.XLAPrecision(mode)]` or `precision=...` instead."
        )
    xla_runtime.check_bf16_supported(str(plugin.precision), device_type, xla_runtime.device_supports_bf16(device_type))
    return plugin


def _uses_lightspeed_xla_strategy(connector: Any) -> bool:
    return isinstance(getattr(connector, "strategy", None), (XLAExactStrategy, SingleDeviceXLAExactStrategy))


def _wrap_check_and_init_precision(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def _check_and_init_precision(self: Any) -> Any:
        uses_accelerator = _uses_lightspeed_xla(self)
        if _uses_lightspeed_xla_strategy(self) and not uses_accelerator:
            raise ValueError(
                f"strategy={self.strategy.strategy_name!r} runs on lightspeed's XLA accelerator, but the accelerator is"
                f" {type(self.accelerator).__name__}. Pass `Trainer(accelerator='xla', ...)` as well."
            )
        if not uses_accelerator:
            return original(self)
        self._validate_precision_choice()
        return resolve_xla_precision(self._precision_flag, self._precision_plugin_flag, self.accelerator.device_type)

    setattr(_check_and_init_precision, _MARK, original)
    return _check_and_init_precision


def install_xla_routing() -> None:
    """Wrap the two connector steps (idempotent; other accelerators are unaffected)."""
    for name, wrap in (
        ("_choose_strategy", _wrap_choose_strategy),
        ("_check_and_init_precision", _wrap_check_and_init_precision),
    ):
        current = getattr(_AcceleratorConnector, name)
        if not hasattr(current, _MARK):
            setattr(_AcceleratorConnector, name, wrap(current))
