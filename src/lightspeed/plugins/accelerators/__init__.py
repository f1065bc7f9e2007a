"""Lightning accelerators: ``XLAAccelerator`` for any PJRT device (registered as ``accelerator="xla"``)."""

from lightspeed.plugins.accelerators.xla import XLAAccelerator

__all__ = ["XLAAccelerator"]
