"""Tell HuggingFace transformers about the ZeRO-3 config while a model is being built.

``from_pretrained`` (and ``from_config``) build a model straight into ZeRO-3 partitions, loading each tensor of the
files into its partition, only when transformers knows that ZeRO-3 is on: its ``HfDeepSpeedConfig`` object must be
alive. Without it, ``from_pretrained`` inside DeepSpeed's ``zero.Init`` (Lightning's ``configure_model``, Fabric's
``init_module``) builds the model on the meta device and loading fails with size-0 mismatches. transformers only holds
a weak reference to that object and reads two things of it, ``is_zero3()`` and ``config``; :func:`transformers_zero3`
registers one for the duration of a ``with`` block (transformers' own ``HfDeepSpeedConfig`` needs accelerate, which
lightspeed does not).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

from lightspeed.core.zero.hf_shard_loading import one_shard_at_a_time

__all__ = ["transformers_zero3"]


class _ZeroConfigForTransformers:
    """What transformers reads of the DeepSpeed config it is told about."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def is_zero3(self) -> bool:
        return int(self.config.get("zero_optimization", {}).get("stage", 0)) == 3

    def is_offload(self) -> bool:
        zero = self.config.get("zero_optimization", {})
        return any(
            str((zero.get(key) or {}).get("device", "none")) in ("cpu", "nvme")
            for key in ("offload_optimizer", "offload_param")
        )


@contextlib.contextmanager
def transformers_zero3(config: dict[str, Any], enabled: bool = True) -> Iterator[None]:
    """Within the block, transformers sees ``config`` as its DeepSpeed config (models it builds are partitioned as
    they are built when the config is ZeRO-3, and loaded one checkpoint shard at a time:
    :mod:`~lightspeed.core.zero.hf_shard_loading`); the previous registration is restored afterwards. A no-op when
    transformers is not installed or ``enabled`` is false."""
    if not enabled or importlib.util.find_spec("transformers") is None:
        yield
        return
    from transformers.integrations import deepspeed as hf_deepspeed

    previous = hf_deepspeed._hf_deepspeed_config_weak_ref
    registered = _ZeroConfigForTransformers(config)
    hf_deepspeed.set_hf_deepspeed_config(registered)
    try:
        with one_shard_at_a_time() if registered.is_zero3() else contextlib.nullcontext():
            yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = previous
