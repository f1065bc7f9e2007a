"""Single-process checks of the generation and transformers links (the 2-rank ZeRO-3 runs are in
tests/strategies/test_zero_pretrained_generation.py and tests/fabric/test_fabric_pretrained_generation.py)."""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from lightspeed.core.zero.generation import keep_generation_in_step, partitioned_over_ranks
from lightspeed.core.zero.hf_link import transformers_zero3


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.calls: list[dict[str, Any]] = []

    def generate(self, inputs: torch.Tensor, synced_gpus: bool | None = None, **kwargs: Any) -> torch.Tensor:
        self.calls.append({"synced_gpus": synced_gpus, **kwargs})
        return inputs


class NotHuggingFace(nn.Module):
    def generate(self, inputs: torch.Tensor) -> torch.Tensor:  # no synced_gpus: left alone
        return inputs


def test_only_generate_methods_that_take_synced_gpus_are_changed_once() -> None:
    model = nn.ModuleDict({"lm": Generator(), "other": NotHuggingFace()})
    assert keep_generation_in_step(model) == ["lm"]
    assert keep_generation_in_step(model) == []  # idempotent
    assert isinstance(model["lm"].generate, types.MethodType)  # Fabric's mark_forward_method accepts it
    assert "generate" not in vars(model["other"])


def test_a_model_that_is_not_partitioned_generates_as_before() -> None:
    lm = Generator()
    keep_generation_in_step(lm)
    assert not partitioned_over_ranks(lm)
    lm.generate(torch.zeros(1), synced_gpus=False, max_new_tokens=3)
    lm.generate(torch.zeros(1))
    assert lm.calls == [{"synced_gpus": False, "max_new_tokens": 3}, {"synced_gpus": None}]


def test_transformers_sees_the_zero3_config_only_inside_the_block() -> None:
    from transformers.integrations.deepspeed import deepspeed_config, is_deepspeed_zero3_enabled

    config = {"zero_optimization": {"stage": 3}}
    with transformers_zero3(config):
        assert is_deepspeed_zero3_enabled() and deepspeed_config() is config
        with transformers_zero3({"zero_optimization": {"stage": 2}}):
            assert not is_deepspeed_zero3_enabled()
        assert is_deepspeed_zero3_enabled()  # the outer registration is restored
    assert not is_deepspeed_zero3_enabled() and deepspeed_config() is None
    with transformers_zero3(config, enabled=False):
        assert not is_deepspeed_zero3_enabled()
