"""The Trainer's ZeRO strategy and the models users bring (:mod:`lightspeed.core.zero.hf_link`,
:mod:`lightspeed.core.zero.generation`), as a mixin placed before Lightning's ``DeepSpeedStrategy``:

* ``model_sharded_context`` (around ``configure_model``): transformers knows the ZeRO-3 config, so
  ``AutoModelForCausalLM.from_pretrained(path)`` builds and loads the model straight into partitions;
* ``init_deepspeed``: every HuggingFace ``generate`` of the module passes ``synced_gpus=True`` while the model is
  partitioned over several ranks, so ranks that stop generating at different steps do not hang.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightspeed.core.zero.generation import keep_generation_in_step
from lightspeed.core.zero.hf_link import transformers_zero3

if TYPE_CHECKING:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    _DeepSpeedStrategyBase = DeepSpeedStrategy  # type-checked as the Lightning strategy it is mixed into
else:
    _DeepSpeedStrategyBase = object

__all__ = ["ZeroModelsMixin"]


class ZeroModelsMixin(_DeepSpeedStrategyBase):
    """Pretrained HuggingFace models built into ZeRO-3 partitions, generation that keeps the ranks in step."""

    config: dict[str, Any]

    @override
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        with super().model_sharded_context(), transformers_zero3(self.config, enabled=self.zero_stage_3):
            yield

    @override
    def init_deepspeed(self) -> None:
        super().init_deepspeed()
        if self.lightning_module is not None:
            keep_generation_in_step(self.lightning_module)
