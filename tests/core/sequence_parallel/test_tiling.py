"""``tile_mlps``: a HuggingFace causal LM whose MLP blocks run over slices of the sequence (DeepSpeed's ``TiledMLP``)
gives the same loss and gradients as the untiled model in one process, and undoing it gives the blocks their own
forward back."""

from __future__ import annotations

import pytest
import torch

from lightspeed.core.errors import SequenceParallelError
from lightspeed.core.sequence_parallel.tiling import tile_mlps


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2
    )
    return LlamaForCausalLM(config)


def _loss_and_gradients(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_tiled_mlps_give_the_untiled_loss_and_gradients() -> None:
    model = _llama()
    ids = torch.randint(0, 32, (2, 64), generator=torch.Generator().manual_seed(1))  # 64 / 16: 4 slices
    want_loss, want = _loss_and_gradients(model, ids)
    undo = tile_mlps(model)
    blocks = [module for module in model.modules() if type(module).__name__ == "LlamaMLP"]
    assert len(blocks) == 2 and all("forward" in vars(block) for block in blocks)
    got_loss, got = _loss_and_gradients(model, ids)
    assert got_loss == pytest.approx(want_loss, abs=1e-6)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-6, msg=name)
    undo()
    assert all("forward" not in vars(block) for block in blocks)


def test_a_model_without_mlp_blocks_is_an_error() -> None:
    with pytest.raises(SequenceParallelError) as caught:
        tile_mlps(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert str(caught.value) == (
        "tiled_mlp=True runs the MLP blocks of the model in slices of the sequence, and Sequential has none (no "
        "module whose class name ends in 'MLP'): leave tiled_mlp off."
    )
