"""Lightning plugins: precision (``plugins/precision``) and accelerators (``plugins/accelerators``). Importing them
does not import torch_xla; the XLA accelerator loads it when a Trainer uses it."""

from lightspeed.plugins.accelerators import XLAAccelerator
from lightspeed.plugins.precision import XLAPrecision

__all__ = ["XLAAccelerator", "XLAPrecision"]
