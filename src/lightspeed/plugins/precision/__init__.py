"""Lightning precision plugins: ``XLAPrecision`` (bf16 and downcast-bf16 by casting, not by environment variables)."""

from lightspeed.plugins.precision.xla import XLAPrecision

__all__ = ["XLAPrecision"]
