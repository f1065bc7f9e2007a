"""lightspeed: DeepSpeed ZeRO, XLA, exact accumulation, exact distributed metrics and safetensors export,
packaged as Lightning strategies, plugins and callbacks.

``import lightspeed`` registers the strategy names (``zero1`` ... ``zero3_nvme``, ``ddp_exact``, ...) with
Lightning's registries. Heavy dependencies (DeepSpeed, torch_xla) are imported only when first used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from lightspeed._lazy import lazy_getattr
from lightspeed.strategies import register_strategies as _register_strategies

_register_strategies()

# public name -> module that defines it; loaded on first access so `import lightspeed` stays fast
_LAZY_ATTRIBUTES = {
    "gather_for_metrics": "lightspeed.core.gather",
    "pad_across_processes": "lightspeed.core.gather",
    "gather_object": "lightspeed.core.gather",
    "GatherError": "lightspeed.core.gather_sync",
}
_LAZY_SUBMODULES = ("callbacks", "core", "export", "plugins", "strategies", "cli")

__all__ = ["__version__", *_LAZY_ATTRIBUTES, *_LAZY_SUBMODULES]


_lazy_attribute = lazy_getattr(__name__, _LAZY_ATTRIBUTES)


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"lightspeed.{name}")
    return _lazy_attribute(name)
