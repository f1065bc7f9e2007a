"""find_hidden_size on tiny Hugging Face models built from configs (nothing downloaded) and on plain modules."""

from __future__ import annotations

import pytest
from torch import nn

from lightspeed.core.zero.config import find_hidden_size


def test_gpt2_uses_config_n_embd():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=24, n_layer=1, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    # GPT-2's MLP has Conv1D layers of width 4*n_embd, so a Linear scan alone could not give 24
    assert find_hidden_size(model) == 24


def test_llama_inside_a_wrapper_module():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=88,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )

    class Wrapper(nn.Module):  # like a LightningModule holding the HF model as an attribute
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(500, 2)  # wider than the hidden size: the config must win
            self.model = transformers.LlamaForCausalLM(config)

    assert find_hidden_size(Wrapper()) == 32


def test_d_model_in_a_dict_config():
    module = nn.Linear(3, 3)
    module.config = {"d_model": 40}  # e.g. T5-style naming, here in a plain dict
    assert find_hidden_size(module) == 40


def test_non_integer_config_values_are_skipped():
    module = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    module.config = {"hidden_size": [64, 128], "d_model": None}  # not a single width: fall back to the layers
    assert find_hidden_size(module) == 8


def test_plain_mlp_uses_widest_linear_input():
    mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    assert find_hidden_size(mlp) == 32


def test_no_linear_gives_none():
    assert find_hidden_size(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())) is None
    assert find_hidden_size(nn.Module()) is None
