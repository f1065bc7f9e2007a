"""``SequenceParallel``: the data-parallel x sequence-parallel layout (sampler ranks, the data-parallel size), the
gradient factor ZeRO-3's reduce-scatter needs, and the layouts and configs it refuses; off (size 1) it changes
nothing. The model's side (the attention and the loss) runs in the multi-process tests of both front ends."""

from __future__ import annotations

import pytest
import torch

from lightspeed.core.errors import SequenceParallelError
from lightspeed.core.sequence_parallel import SequenceParallel
from lightspeed.core.sequence_parallel.ulysses import find_causal_lm


def test_ranks_are_grouped_consecutively_and_a_group_reads_the_same_rows() -> None:
    parallel = SequenceParallel(2)
    assert [parallel.sampler_kwargs(6, rank) for rank in range(6)] == [
        {"num_replicas": 3, "rank": rank // 2} for rank in range(6)
    ]
    assert parallel.data_parallel_size(6) == 3


def test_zero3_gradients_are_scaled_by_the_group_size_and_zero1_2_are_not() -> None:
    parallel = SequenceParallel(4)
    assert parallel.gradient_factor(3) == 4.0
    assert parallel.gradient_factor(2) == 1.0
    assert float(parallel.scale_loss(torch.full((), 0.5), 3)) == 2.0
    assert SequenceParallel(1).gradient_factor(3) == 1.0


def test_off_it_leaves_batches_and_worlds_alone() -> None:
    parallel = SequenceParallel()
    batch = {"input_ids": torch.ones(2, 3)}
    assert not parallel.enabled and parallel.shard(batch) is batch and parallel.sampler_kwargs(4, 1) is None
    loss = torch.ones(())
    assert parallel.scale_loss(loss, 3) is loss
    parallel.check_world(3)
    assert parallel.install(torch.nn.Linear(1, 1)) is None


def test_a_world_that_does_not_split_into_groups_is_an_error() -> None:
    with pytest.raises(SequenceParallelError) as caught:
        SequenceParallel(4).check_world(6)
    assert str(caught.value) == (
        "sequence_parallel_size=4 splits the world into groups of 4 ranks, but the run has 6 process(es): use a "
        "number of devices x nodes divisible by 4."
    )


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_the_size_is_a_whole_number(size: object) -> None:
    with pytest.raises(SequenceParallelError, match=r"^sequence_parallel_size must be a whole number >= 1, got "):
        SequenceParallel(size)  # type: ignore[arg-type]


@pytest.mark.parametrize("chunks", [0, -3, 2.0, "yes", None])
def test_tiled_logits_loss_is_a_switch_or_the_tokens_per_chunk(chunks: object) -> None:
    with pytest.raises(SequenceParallelError) as caught:
        SequenceParallel(1, tiled_logits_loss=chunks)  # type: ignore[arg-type]
    assert str(caught.value) == (
        f"tiled_logits_loss must be True, False or the tokens per chunk (a whole number >= 1), got {chunks!r}."
    )


def test_zero3_reduction_paths_whose_averaging_differs_per_bucket_are_refused() -> None:
    zero = {"stage": 3, "reduce_scatter": False}
    with pytest.raises(SequenceParallelError) as caught:
        SequenceParallel(2).check_config(3, zero)
    assert str(caught.value) == (
        "ZeRO-3 with reduce_scatter=false averages some gradient buckets over the data-parallel groups and others over "
        "every rank when sequences are split, and no loss scale makes both right: leave them at their defaults (true) "
        "with sequence_parallel_size > 1."
    )
    SequenceParallel(2).check_config(2, {"stage": 2, "reduce_scatter": False})
    SequenceParallel(1).check_config(3, zero)


def test_the_model_must_hold_exactly_one_huggingface_causal_lm() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    model = LlamaForCausalLM(config)
    holder = torch.nn.Module()
    holder.model = model
    assert find_causal_lm(holder) is model
    holder.teacher = LlamaForCausalLM(config)
    with pytest.raises(SequenceParallelError) as caught:
        find_causal_lm(holder)
    assert str(caught.value).startswith(
        "sequence_parallel_size > 1 replaces the attention of one HuggingFace causal language model (a transformers "
        "*ForCausalLM, e.g. LlamaForCausalLM) and found 2 (LlamaForCausalLM, LlamaForCausalLM) in Module."
    )
    with pytest.raises(SequenceParallelError, match=r"and found none in Linear\. Build the model with transformers"):
        find_causal_lm(torch.nn.Linear(2, 2))


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    return LlamaForCausalLM(config)


def test_the_tilings_install_and_remove_without_a_trace() -> None:
    model = _tiny_llama()
    before = {name: set(vars(module)) for name, module in model.named_modules()}
    plan = SequenceParallel(1, tiled_mlp=True, tiled_logits_loss=3)
    assert plan.install(model) is None  # no sequence parallelism: no mpu
    assert (
        "forward" in vars(model) and "forward" in vars(model.lm_head) and "forward" in vars(model.model.layers[0].mlp)
    )
    plan.remove()
    assert {name: set(vars(module)) for name, module in model.named_modules()} == before


def test_a_refused_tiling_leaves_the_model_as_it_was() -> None:
    """tiled_mlp installs first; tiled_logits_loss then refuses a loss function of the user's own: the MLPs are
    given their own forward back."""
    model = _tiny_llama()
    model.loss_function = lambda *args, **kwargs: torch.zeros(())  # type: ignore[method-assign, assignment]
    before = {name: set(vars(module)) for name, module in model.named_modules()}
    with pytest.raises(SequenceParallelError, match=r"^tiled_logits_loss computes HuggingFace's causal-LM"):
        SequenceParallel(1, tiled_mlp=True, tiled_logits_loss=True).install(model)
    assert {name: set(vars(module)) for name, module in model.named_modules()} == before


def test_the_tiled_logits_loss_is_refused_with_compilation() -> None:
    with pytest.raises(SequenceParallelError) as caught:
        SequenceParallel(1, tiled_logits_loss=True).install(_tiny_llama(), compiled=True)
    assert str(caught.value) == (
        "tiled_logits_loss replaces the forward of the model and of its output embeddings, which has not been tested "
        "with compilation (compile=True or a torch.compile'd model): leave one of them off."
    )
    SequenceParallel(1, tiled_mlp=True).install(_tiny_llama(), compiled=True)  # the other tiling is not concerned
