"""Fabric's ZeRO strategy and the models users bring, as a mixin placed before Lightning Fabric's
``DeepSpeedStrategy``: inside ``fabric.init_module()`` transformers knows the ZeRO-3 config
(:mod:`lightspeed.core.zero.partitioned_build`), so ``AutoModelForCausalLM.from_pretrained(path)`` builds and loads the
model straight into partitions, and layers deep-copied there (``nn.TransformerEncoder``) are partitioned copies.

The Trainer's mixin also keeps generation in step; here ``fabric.setup`` does that
(:class:`~lightspeed.fabric.ZeroFabricStrategy` builds the engine itself, :mod:`lightspeed.core.zero.generation`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from typing_extensions import override

from lightspeed.core.zero.nvme_swapping import lightspeed_parameter_swapper
from lightspeed.core.zero.partitioned_build import building_into_partitions
from lightspeed.fabric.mixin_bases import DeepSpeedStrategyBase

__all__ = ["ZeroModelsMixin"]


class ZeroModelsMixin(DeepSpeedStrategyBase):
    """Pretrained HuggingFace models built into ZeRO-3 partitions under ``fabric.init_module()``."""

    config: dict[str, Any]

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        return self._sharded_build(super().module_sharded_context)

    @contextmanager
    def _sharded_build(self, sharded: Callable[[], AbstractContextManager]) -> Generator[None, None, None]:
        """Lightning's ``zero.Init`` context, made (DeepSpeed sets up its parameter swapper then) inside
        lightspeed's swapper sizing, and lightspeed's build context."""
        with (
            lightspeed_parameter_swapper(self.config),
            sharded(),
            building_into_partitions(self.config, self.zero_stage_3),
        ):
            yield
