"""``tile_logits_loss``: a HuggingFace causal LM whose loss runs over chunks of its tokens gives the untiled loss and
the untiled gradients (the output projection's included, after the loss is scaled) without ever holding the whole
logits; it keeps the class forward for evaluation, composes with sequence parallelism's loss wrapper, leaves the
model exactly as it was when undone, and refuses the models whose loss it would change.

The last test runs one ZeRO-3 step in a process of its own (this file run as a script): tiled and untiled engines
end with the same weights."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from _support.launch import run_python
from _support.long_context import VOCAB, PaddedTokens, collate, llama_config
from lightspeed.core.errors import SequenceParallelError
from lightspeed.core.sequence_parallel import logits as logits_module
from lightspeed.core.sequence_parallel.batch import shard_batch
from lightspeed.core.sequence_parallel.logits import tile_logits_loss
from lightspeed.core.sequence_parallel.loss import sequence_parallel_loss

CHUNK = 5  # 2 rows x 31 positions: 12 chunks of 5 tokens and one of 2
HIDDEN = llama_config().hidden_size
FACTOR = 0.37  # what the loss is multiplied by before backward: every gradient must see it


def _llama(**overrides: Any) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(**overrides)).train()


def _pair(**overrides: Any) -> tuple[Any, Any, Any]:
    """Two identical tiny Llamas, the second tiled at :data:`CHUNK` tokens per chunk, and its undo."""
    plain, tiled = _llama(**overrides), _llama(**overrides)
    return plain, tiled, tile_logits_loss(tiled, CHUNK)


def _batch() -> dict[str, torch.Tensor]:
    """Two right-padded rows whose prompts and pads are labelled -100."""
    return collate(PaddedTokens(), [0, 1])


def _step(model: Any, batch: dict[str, Any]) -> tuple[Any, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    out = model(**batch)
    (out.loss * FACTOR).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters(remove_duplicate=False)}
    return out, out.loss.detach(), grads


def _assert_same_step(plain: Any, tiled: Any, batch: dict[str, Any]) -> None:
    want_out, want_loss, want = _step(plain, batch)
    got_out, got_loss, got = _step(tiled, batch)
    assert want_out.logits is not None and got_out.logits is None
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=1e-6)
    assert sorted(got) == sorted(want) and "lm_head.weight" in got
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------------------------------------------ the same step
@pytest.mark.parametrize("labels", ["ignored", "every-token"])
def test_the_tiled_loss_and_gradients_equal_the_untiled_ones(labels: str) -> None:
    plain, tiled, _ = _pair()
    batch = _batch()
    if labels == "every-token":
        batch = {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}
    else:
        assert (batch["labels"] == -100).any() and (batch["labels"] != -100).any()
    _assert_same_step(plain, tiled, batch)


def test_tied_word_embeddings_get_both_gradients() -> None:
    plain, tiled, _ = _pair(tie_word_embeddings=True)
    assert tiled.lm_head.weight is tiled.model.embed_tokens.weight
    _assert_same_step(plain, tiled, _batch())


def test_shift_labels_and_num_items_in_batch_as_a_sequence_parallel_batch_passes_them() -> None:
    plain, tiled, _ = _pair()
    batch = shard_batch(_batch(), rank=0, size=1)  # the whole sequence, labels shifted, the targets counted
    assert set(batch) >= {"shift_labels", "num_items_in_batch"}
    _assert_same_step(plain, tiled, batch)
    batch["num_items_in_batch"] = batch["num_items_in_batch"] * 3  # a window of several micro-batches
    _assert_same_step(plain, tiled, batch)


@pytest.mark.parametrize("tokens_per_chunk", [1, CHUNK, None], ids=["one-token", "uneven", "default"])
def test_the_loss_runs_in_chunks_of_the_given_tokens(
    tokens_per_chunk: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, tiled = _llama(), _llama()
    tile_logits_loss(tiled, tokens_per_chunk)
    chunks: list[int] = []
    chunk_loss = logits_module._chunk_cross_entropy

    def counted(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        chunks.append(hidden.shape[0])
        return chunk_loss(hidden, *args)

    monkeypatch.setattr(logits_module, "_chunk_cross_entropy", counted)
    _assert_same_step(plain, tiled, _batch())
    size = tokens_per_chunk or (1 << 30) // (4 * VOCAB)
    forward = [min(size, 62 - start) for start in range(0, 62, size)]
    assert chunks == forward + forward[::-1]  # each chunk in the forward, then again (last first) in the backward


def test_no_tensor_of_more_than_one_chunk_of_logits_exists_in_forward_or_backward() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestLogits(TorchDispatchMode):
        """The most rows any tensor ending in the vocabulary size had (the MLP is narrower here; the output
        projection's weight, transposed in the backward, aside)."""

        rows = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if (
                    isinstance(tensor, torch.Tensor)
                    and tensor.ndim
                    and tensor.shape[-1] == VOCAB
                    and tuple(tensor.shape) != (HIDDEN, VOCAB)
                ):
                    LargestLogits.rows = max(LargestLogits.rows, tensor.numel() // VOCAB)
            return out

    plain, tiled, _ = _pair(intermediate_size=48)
    for model, rows in ((plain, 62), (tiled, CHUNK)):
        LargestLogits.rows = 0
        with LargestLogits():
            _step(model, _batch())
        assert LargestLogits.rows == rows, type(model)


# ------------------------------------------------------------------------------------------------ the class forward
def test_without_gradients_the_class_forward_returns_the_logits_and_the_same_loss() -> None:
    plain, tiled, _ = _pair()
    with torch.no_grad():
        want, got = plain(**_batch()), tiled(**_batch())
    assert got.logits is not None
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)


def test_without_labels_or_with_logits_to_keep_the_class_forward_runs() -> None:
    plain, tiled, _ = _pair()
    batch = _batch()
    del batch["labels"]
    torch.testing.assert_close(tiled(**batch).logits, plain(**batch).logits, rtol=0, atol=0)
    kept = tiled(**batch, logits_to_keep=1)
    assert kept.logits.shape == (2, 1, VOCAB)
    for model in (plain, tiled):  # with labels too: HuggingFace's loss on the kept logits, whatever it makes of them
        with pytest.raises(ValueError, match=re.escape("Expected input batch_size (2) to match target batch_size")):
            model(**_batch(), logits_to_keep=1)


def test_return_dict_false_gives_the_tuple_without_logits() -> None:
    plain, tiled, _ = _pair()
    want, got = plain(**_batch(), return_dict=False), tiled(**_batch(), return_dict=False)
    assert isinstance(got, tuple) and len(got) == len(want) - 1  # (loss, cache): no logits
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------ composing, undoing
def test_sequence_parallel_loss_wraps_the_tiled_loss_and_both_undo_in_reverse_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain, tiled = _llama(), _llama()
    before = set(vars(tiled)), set(vars(tiled.lm_head))
    undo = tile_logits_loss(tiled, CHUNK)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None: None)  # a group of one rank
    # what UlyssesInstallation does to the loss, installed after the tiling and removed before its undo
    had_own_loss, original = "_loss_function" in vars(tiled), tiled.loss_function
    computed: list[bool] = []
    tiled.loss_function = sequence_parallel_loss(original, None, lambda: computed.append(True))
    assert had_own_loss
    _assert_same_step(plain, tiled, shard_batch(_batch(), rank=0, size=1))
    assert computed == [True]
    tiled.loss_function = original
    undo()
    assert (set(vars(tiled)), set(vars(tiled.lm_head))) == before
    assert tiled.loss_function is plain.loss_function


def test_undo_gives_the_model_its_own_forward_loss_and_logits_back() -> None:
    plain, tiled = _llama(), _llama()
    before = set(vars(tiled)), set(vars(tiled.lm_head))
    undo = tile_logits_loss(tiled, CHUNK)
    assert {"forward", "_loss_function"} <= set(vars(tiled)) and "forward" in vars(tiled.lm_head)
    undo()
    assert (set(vars(tiled)), set(vars(tiled.lm_head))) == before
    assert tiled.loss_function is plain.loss_function
    want_out, want_loss, want = _step(plain, _batch())
    got_out, got_loss, got = _step(tiled, _batch())
    torch.testing.assert_close(got_out.logits, want_out.logits, rtol=0, atol=0)
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    undo()  # a second undo changes nothing
    assert (set(vars(tiled)), set(vars(tiled.lm_head))) == before
    tile_logits_loss(tiled, CHUNK)  # and the model can be tiled again
    _assert_same_step(plain, tiled, _batch())


# ------------------------------------------------------------------------------------------------ refusals
NOT_PLAIN = (
    "tiled_logits_loss computes the loss of {name} without its logits, which keeps the loss exact only for the plain "
    "causal-LM forward (the base model, the output projection, HuggingFace's loss, nothing done to the logits and no "
    "other loss added), and "
)


def _tiny(config_class: str, model_class: str, **settings: Any) -> Any:
    import transformers

    config = getattr(transformers, config_class)(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        **settings,
    )
    return getattr(transformers, model_class)(config)


@pytest.mark.parametrize(
    ("config_class", "model_class", "settings", "statement", "expected"),
    [
        (
            "Gemma2Config",
            "Gemma2ForCausalLM",
            {"head_dim": 16},
            "if self.config.final_logit_softcapping is not None:",
            "`loss = None`",
        ),
        (
            "MixtralConfig",
            "MixtralForCausalLM",
            {"num_local_experts": 2, "num_experts_per_tok": 1},
            "output_router_logits = output_router_logits if output_router_logits is not None else "
            "self.config.output_router_logits",
            "`outputs = self.model(<its parameters>, **kwargs)` first",
        ),
    ],
    ids=["gemma2-softcapping", "mixtral-router-loss"],
)
def test_a_forward_that_changes_the_logits_or_adds_a_loss_is_refused(
    config_class: str, model_class: str, settings: dict[str, Any], statement: str, expected: str
) -> None:
    model = _tiny(config_class, model_class, **settings)
    before = set(vars(model))
    with pytest.raises(SequenceParallelError, match=re.escape(NOT_PLAIN.format(name=model_class))) as caught:
        tile_logits_loss(model, CHUNK)
    assert str(caught.value).endswith(
        f"{model_class}.forward has `{statement}` where the plain forward has {expected}: leave tiled_logits_loss off "
        "for this model."
    )
    assert set(vars(model)) == before


def test_llama_mistral_and_qwen2_are_plain() -> None:
    for config_class, model_class in (("MistralConfig", "MistralForCausalLM"), ("Qwen2Config", "Qwen2ForCausalLM")):
        tile_logits_loss(_tiny(config_class, model_class), CHUNK)()
    tile_logits_loss(_llama(), None)()


def test_a_subclass_with_its_own_forward_is_refused() -> None:
    from transformers import LlamaForCausalLM

    class Scaled(LlamaForCausalLM):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    torch.manual_seed(0)
    with pytest.raises(SequenceParallelError) as caught:
        tile_logits_loss(Scaled(llama_config()), CHUNK)
    assert str(caught.value) == NOT_PLAIN.format(name="Scaled") + (
        "Scaled.forward has decorators [], not the plain ones (['auto_docstring', 'can_return_tuple', "
        "'deprecate_kwarg']): leave tiled_logits_loss off for this model."
    )


def test_a_custom_loss_function_is_refused() -> None:
    model = _llama()

    def my_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **kwargs: Any) -> torch.Tensor:
        return logits.sum()

    model.loss_function = my_loss
    with pytest.raises(SequenceParallelError) as caught:
        tile_logits_loss(model, CHUNK)
    assert str(caught.value) == (
        "tiled_logits_loss computes HuggingFace's causal-LM cross-entropy (ForCausalLMLoss) chunk by chunk, and "
        "LlamaForCausalLM uses another loss function (test_a_custom_loss_function_is_refused.<locals>.my_loss): "
        "leave tiled_logits_loss off, or give the model its default loss_function."
    )
    assert vars(model)["_loss_function"] is my_loss and "forward" not in vars(model)


def test_output_embeddings_that_are_not_a_plain_linear_are_refused() -> None:
    class Adapted(torch.nn.Linear):
        pass

    model = _llama()
    model.lm_head = Adapted(32, VOCAB, bias=False)
    with pytest.raises(SequenceParallelError) as caught:
        tile_logits_loss(model, CHUNK)
    assert str(caught.value) == (
        "tiled_logits_loss computes the output projection chunk by chunk from a torch.nn.Linear's weight and bias, "
        "and LlamaForCausalLM's output embeddings are Adapted (an adapter, quantized or custom layer): leave "
        "tiled_logits_loss off for this model."
    )


def test_output_embeddings_replaced_after_the_install_are_an_error_at_the_next_training_forward() -> None:
    model = _llama()
    tile_logits_loss(model, CHUNK)
    model.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)  # e.g. an adapter put on lm_head afterwards
    with pytest.raises(SequenceParallelError) as caught:
        model(**_batch())
    assert str(caught.value) == (
        "LlamaForCausalLM's output embeddings were replaced (now Linear) after tiled_logits_loss was installed on it, "
        "and the tiled loss would still use the old ones: replace them (an adapter on lm_head, say) before the model "
        "is set up for training, or leave tiled_logits_loss off."
    )


@pytest.mark.parametrize("where", ["model", "head"])
def test_a_forward_already_set_on_the_instance_is_refused(where: str) -> None:
    model = _llama()
    module = model if where == "model" else model.lm_head
    module.forward = module.forward  # a bound method of its own, as a patch leaves it
    what = "LlamaForCausalLM" if where == "model" else "LlamaForCausalLM's output embeddings"
    with pytest.raises(SequenceParallelError) as caught:
        tile_logits_loss(model, CHUNK)
    assert str(caught.value) == (
        f"tiled_logits_loss replaces the forward of LlamaForCausalLM and of its output embeddings, and {what} "
        "already has a forward of its own set on the instance (another library's or an activation-checkpointing "
        "patch): leave tiled_logits_loss off, or do not replace that forward."
    )


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch._dynamo
@pytest.mark.parametrize("how", ["module.compile()", "torch.compile(module)", "lm_head.compile()"])
def test_a_compiled_model_is_refused(how: str) -> None:
    model, what = _llama(), "LlamaForCausalLM"
    if how == "module.compile()":
        model.compile()  # compiles lazily, at the first call: none here
    elif how == "torch.compile(module)":
        model = torch.compile(model)
    else:
        model.lm_head.compile()
        what = "LlamaForCausalLM's output embeddings"
    with pytest.raises(SequenceParallelError) as caught:
        tile_logits_loss(model, CHUNK)
    assert str(caught.value) == (
        f"tiled_logits_loss replaces the forward of LlamaForCausalLM and of its output embeddings, and {what} was "
        "compiled with torch.compile, which it has not been tested with: train without torch.compile, or leave "
        "tiled_logits_loss off."
    )


@pytest.mark.parametrize("tokens_per_chunk", [0, True, 2.5])
def test_tokens_per_chunk_must_be_a_whole_number(tokens_per_chunk: Any) -> None:
    with pytest.raises(SequenceParallelError) as caught:
        tile_logits_loss(_llama(), tokens_per_chunk)
    assert str(caught.value) == (
        "tiled_logits_loss takes the tokens per chunk as a whole number >= 1 (or None: about 1 GiB of float32 "
        f"logits per chunk), got {tokens_per_chunk!r}."
    )


def test_a_model_that_is_not_a_huggingface_causal_lm_is_refused() -> None:
    with pytest.raises(SequenceParallelError) as caught:
        tile_logits_loss(torch.nn.Sequential(torch.nn.Linear(2, 2)), CHUNK)
    assert str(caught.value) == (
        "tiled_logits_loss computes the loss of a HuggingFace causal language model (a transformers *ForCausalLM, "
        "e.g. LlamaForCausalLM), and Sequential is not one: leave tiled_logits_loss off."
    )


# ------------------------------------------------------------------------------------------------ ZeRO-3
def test_a_zero3_step_with_the_tiled_loss_gives_the_untiled_weights(tmp_path: Path) -> None:
    """One process, one rank, parameters gathered by ZeRO-3's hooks (nothing persistent): the tiled engine's step
    (loss x :data:`FACTOR`) ends where the untiled one does."""
    run_python(Path(__file__), [str(tmp_path)], env={"DS_ACCELERATOR": "cpu"}, timeout=300)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["chunks"] == 2 * 13  # the tiled path ran: 13 chunks forward, 13 again backward
    for name, difference in result["difference"].items():
        assert difference <= 1e-6, name
    assert abs(result["loss"][0] - result["loss"][1]) <= 1e-6
    assert result["moved"] > 1e-3  # the step did change the output projection
    # its weight was released after its one call in the forward, so the backward's recomputed chunks ran on the weight
    # ZeRO-3 gathered again for them (a released weight is empty: F.linear would have failed)
    assert result["status"] == ["NOT_AVAILABLE", "NOT_AVAILABLE"]


def _zero3_step(out: Path) -> None:
    import deepspeed

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    deepspeed.init_distributed(dist_backend="gloo")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    chunks: list[int] = []
    chunk_loss = logits_module._chunk_cross_entropy

    def counted(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        chunks.append(hidden.shape[0])
        return chunk_loss(hidden, *args)

    logits_module._chunk_cross_entropy = counted
    weights, losses, statuses = [], [], []
    start = _llama().lm_head.weight.detach().clone()
    for tiled in (False, True):
        model = _llama()
        if tiled:
            tile_logits_loss(model, CHUNK)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        loss = engine(**_batch()).loss
        statuses.append(engine.module.lm_head.weight.ds_status.name)  # released after its call
        engine.backward(loss * FACTOR)
        engine.step()
        losses.append(float(loss.detach()))
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            weights.append({name: p.detach().clone() for name, p in engine.module.named_parameters()})
        engine.destroy()
    difference = {name: float((weights[1][name] - want).abs().max()) for name, want in weights[0].items()}
    moved = float((weights[1]["lm_head.weight"] - start).abs().max())
    result = {"chunks": len(chunks), "difference": difference, "loss": losses, "moved": moved, "status": statuses}
    (out / "result.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _zero3_step(Path(sys.argv[1]))
