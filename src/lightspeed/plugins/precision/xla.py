"""XLA precision by direct casting: ``bf16-true``, ``bf16-downcast``, ``bf16-mixed`` and ``32-true``.

torch_xla's ``XLA_USE_BF16`` / ``XLA_DOWNCAST_BF16`` switches are deprecated (they warn from 2.5 and are slated
for removal) and Lightning's XLA precision relies on them. This plugin reaches the same numerics by casting the
module's parameters and buffers and every floating batch tensor itself, so it behaves the same on torch_xla
versions with and without those variables, and it never sets them.

Modes:
    ``bf16-true``      float32 and float64 parameters, buffers and inputs become bfloat16.
    ``bf16-downcast``  float32 becomes bfloat16, float64 becomes float32 (metrics and logged values stay usable).
    ``bf16-mixed``     autocast to bfloat16 on the XLA device, float32 master weights.
    ``32-true``        nothing is cast.

In ``bf16-downcast`` and ``bf16-mixed`` the inputs handed to torchmetrics metrics are cast up to float32 before
the metric sees them (their states are never cast down), and values passed to ``self.log`` are accumulated by
Lightning in float32; so metrics and logs are computed in float32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import torch
from lightning.pytorch.plugins.precision.xla import XLAPrecision as _LightningXLAPrecision
from torch.nn import Module
from typing_extensions import override

from lightspeed.core.xla.casting import cast_floating_tensors, cast_module_tensors, upcast_metric_updates

__all__ = ["DEPRECATED_XLA_ENV_VARS", "XLA_PRECISION_MODES", "XLAPrecision"]

XLA_PRECISION_MODES = ("bf16-true", "bf16-downcast", "bf16-mixed", "32-true")

# mode -> {dtype found in the model or batch: dtype it becomes}
_CAST_MAPS: dict[str, dict[torch.dtype, torch.dtype]] = {
    "bf16-true": {torch.float32: torch.bfloat16, torch.float64: torch.bfloat16},
    "bf16-downcast": {torch.float32: torch.bfloat16, torch.float64: torch.float32},
    "bf16-mixed": {},
    "32-true": {},
}

# the torch_xla switches this plugin replaces; it must never set them
DEPRECATED_XLA_ENV_VARS = ("XLA_USE_BF16", "XLA_DOWNCAST_BF16", "XLA_USE_F16")


def _validate_xla_precision(mode: object) -> str:
    """Return ``mode`` if it is one of :data:`XLA_PRECISION_MODES`, else raise a ``ValueError`` listing them."""
    if mode not in XLA_PRECISION_MODES:
        choices = ", ".join(repr(m) for m in XLA_PRECISION_MODES)
        raise ValueError(
            f"XLAPrecision got an unknown precision mode {mode!r}. Choose one of: {choices}"
            " (`bf16-downcast` is only available as `plugins=[XLAPrecision('bf16-downcast')]`)."
        )
    return str(mode)


class _DefaultDtype(contextlib.ContextDecorator):
    """Sets ``torch``'s default floating dtype for the duration of the block."""

    def __init__(self, dtype: torch.dtype) -> None:
        self._dtype = dtype
        self._previous = torch.get_default_dtype()

    def __enter__(self) -> None:
        self._previous = torch.get_default_dtype()
        torch.set_default_dtype(self._dtype)

    def __exit__(self, *exc: Any) -> None:
        torch.set_default_dtype(self._previous)


class XLAPrecision(_LightningXLAPrecision):
    """Precision plugin for XLA devices that casts modules and batches itself (no ``XLA_USE_BF16``).

    Args:
        precision: one of ``"bf16-true"``, ``"bf16-downcast"``, ``"bf16-mixed"``, ``"32-true"``.

    Example::

        trainer = L.Trainer(accelerator="xla", devices=1, plugins=[XLAPrecision("bf16-downcast")])
    """

    def __init__(self, precision: str = "32-true") -> None:
        # Lightning's __init__ sets XLA_USE_BF16 / XLA_USE_F16; it is deliberately not called.
        self.precision = _validate_xla_precision(precision)  # type: ignore[assignment]
        self._cast_map = _CAST_MAPS[self.precision]
        self._desired_dtype = torch.bfloat16 if self.precision in ("bf16-true", "bf16-downcast") else torch.float32

    @property
    def uses_bf16(self) -> bool:
        """Whether this mode computes in bfloat16 (all modes but ``32-true``)."""
        return self.precision != "32-true"

    # ---- module and data -------------------------------------------------------------------------------------
    @override
    def convert_module(self, module: Module) -> Module:
        """Cast parameters and buffers in place per mode; wrap metrics so they compute in float32."""
        cast_module_tensors(module, self._cast_map)
        if self.precision in ("bf16-downcast", "bf16-mixed"):
            upcast_metric_updates(module)
        return module

    @override
    def convert_input(self, data: Any) -> Any:
        """Cast floating tensors of a batch per mode (float64 -> float32 in downcast, everything -> bf16 in true)."""
        return cast_floating_tensors(data, self._cast_map)

    @override
    def convert_output(self, data: Any) -> Any:
        """Hand bfloat16 outputs back as float32 so that predictions and returned values are usable."""
        if not self.uses_bf16:
            return data
        return cast_floating_tensors(data, {torch.bfloat16: torch.float32})

    @override
    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """In the bf16 casting modes, tensors created during model init are bfloat16 from the start."""
        if self.precision in ("bf16-true", "bf16-downcast"):
            return _DefaultDtype(torch.bfloat16)
        return contextlib.nullcontext()

    @override
    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    @contextlib.contextmanager
    @override
    def forward_context(self) -> Generator[None, None, None]:
        """Autocast on the XLA device in ``bf16-mixed``; bf16 default dtype in the casting modes."""
        if self.precision == "bf16-mixed":
            with torch.autocast("xla", dtype=torch.bfloat16):
                yield
        elif self.precision in ("bf16-true", "bf16-downcast"):
            with _DefaultDtype(torch.bfloat16):
                yield
        else:
            yield

    # optimizer_step is Lightning's XLA one: run the closure, all-reduce gradients over replicas
    # (``xm.reduce_gradients``, once per optimizer step, i.e. at accumulation window boundaries), step, mark_step.

    @override
    def teardown(self) -> None:
        """Nothing to undo: no environment variable was set (Lightning's would delete the user's XLA_USE_BF16)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.precision!r})"
