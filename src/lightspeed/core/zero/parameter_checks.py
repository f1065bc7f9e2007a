"""Parameters a ZeRO engine cannot train the way one plain process does, refused before anything is cast or built.

* float64: Lightning's DeepSpeed precision plugin casts the module to float32 under ``"32-true"`` and DeepSpeed casts
  it to bf16/fp16 under mixed precision, so a float64 parameter would silently train in another precision;
* 0-dimensional (a scalar such as CLIP's ``logit_scale``): DeepSpeed's first broadcast views every parameter as
  bytes, which a 0-dim tensor cannot be, and fails with a message that names neither the parameter nor a remedy.
"""

from __future__ import annotations

import torch
from torch import nn

from lightspeed.core.errors import DeepSpeedConfigError

__all__ = ["check_parameters_for_zero"]


def _listed(names: list[str]) -> str:
    shown = ", ".join(f"'{name}'" for name in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def check_parameters_for_zero(module: nn.Module) -> None:
    """Raise one :class:`DeepSpeedConfigError` naming every float64 or 0-dimensional parameter of ``module`` (a
    ZeRO-3 partitioned parameter is judged by its full shape) and what to change."""
    problems = []
    wide = [name for name, param in module.named_parameters() if param.dtype == torch.float64]
    if wide:
        they, them = ("it", "it") if len(wide) == 1 else ("they", "them")
        problems.append(
            f"{_listed(wide)} {'is' if len(wide) == 1 else 'are'} float64, but ZeRO trains float32 parameters (with "
            f"bf16/fp16 copies under mixed precision): {they} would be cast without a word and train unlike one "
            f"process. Make {them} float32 in the model (`.float()`), or train the model with a strategy that keeps "
            "float64 (ddp)."
        )
    scalars = [name for name, param in module.named_parameters() if len(getattr(param, "ds_shape", param.shape)) == 0]
    if scalars:
        what = "is a 0-dimensional parameter" if len(scalars) == 1 else "are 0-dimensional parameters"
        problems.append(
            f"{_listed(scalars)} {what}, which DeepSpeed cannot broadcast (it fails with 'self.dim() cannot be 0 to "
            "view Float as Byte'). Give each one element: `nn.Parameter(torch.tensor([2.0]))` instead of "
            "`torch.tensor(2.0)` (it broadcasts the same in arithmetic)."
        )
    if problems:
        raise DeepSpeedConfigError(
            "The model has parameters ZeRO cannot train as one process does: " + " ".join(problems)
        )
