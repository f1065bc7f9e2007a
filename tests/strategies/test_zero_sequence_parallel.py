"""Ulysses sequence parallelism under the Trainer (``ZeroStrategy(sequence_parallel_size=2)``, CPU, gloo): a tiny
pretrained Llama on right-padded batches with masked prompts trains exactly as one plain process on the whole
sequences, on 2 ranks (1 data-parallel group x 2) and 4 (2 x 2), under ZeRO-2 and ZeRO-3, with gradient
accumulation; the loss every rank logs is the whole micro-batch's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from _support import long_context
from _support.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_sequence_parallel.py"


def _launch(tmp_path: Path, world: int, runs: list[str]) -> list[dict[str, Any]]:
    long_context.write_pretrained(tmp_path / "pretrained")
    long_context.write_pretrained(tmp_path / "one_head", num_attention_heads=1, num_key_value_heads=1)
    long_context.write_pretrained(tmp_path / "one_kv_head", num_key_value_heads=1)
    run_torchrun(SCRIPT, world, [str(tmp_path), ",".join(runs)], timeout=600)
    return [torch.load(tmp_path / f"result_{rank}.pt") for rank in range(world)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("sp_two")
    runs = [
        "zero2",
        "zero3",
        "zero3_tiled",
        "zero3_one_kv_head",
        "zero3_lora",
        "zero3_tiled_logits",
        "zero2_accumulate_tiled_logits",
        "zero3_tiled_logits_data_parallel",
        "zero3_checkpointed",
        "zero3_clip",
        "zero2_accumulate",
        "zero3_resume",
        "generate",
        "own_loss",
        "rank_rows",
        "gather_metrics",
        "gather_per_sequence",
        "rebuilt",
        "bad_world",
        "one_head",
        "eager",
    ]
    return out, _launch(out, 2, runs)


@pytest.mark.parametrize("run", ["zero2", "zero3", "zero3_tiled", "zero3_tiled_logits", "zero3_checkpointed"])
def test_one_group_of_two_trains_like_one_process_on_whole_sequences(two_ranks: Any, run: str) -> None:
    out, results = two_ranks
    want = long_context.reference(out / "pretrained", data_parallel=1, steps=2)
    for rank, result in enumerate(results):
        long_context.assert_close(result[run]["state"], want, f"{run} rank {rank}")


def test_key_value_heads_fewer_than_the_group_are_shared_and_train_like_one_process(two_ranks: Any) -> None:
    """4 attention heads sharing 1 key/value head (grouped-query attention) over 2 ranks: each rank gets two query
    heads and a copy of the key/value head."""
    out, results = two_ranks
    want = long_context.reference(out / "one_kv_head", data_parallel=1, steps=2)
    for rank, result in enumerate(results):
        long_context.assert_close(result["zero3_one_kv_head"]["state"], want, f"rank {rank}")


def test_a_lora_model_trains_like_one_process(two_ranks: Any) -> None:
    """peft's LoRA on the attention's query and value projections (the rest frozen): the attention replaced inside
    the PeftModel's causal LM, the adapters trained as one process trains them."""
    out, results = two_ranks
    want = long_context.reference(out / "pretrained", data_parallel=1, steps=2, lora=True)
    for rank, result in enumerate(results):
        long_context.assert_close(result["zero3_lora"]["state"], want, f"rank {rank}")


def test_gradients_are_clipped_by_the_norm_of_the_whole_gradient(two_ranks: Any) -> None:
    out, results = two_ranks
    want = long_context.reference(out / "pretrained", data_parallel=1, steps=2, clip=0.05)
    unclipped = long_context.reference(out / "pretrained", data_parallel=1, steps=2)
    assert any(not torch.allclose(want[key], unclipped[key], rtol=0, atol=1e-5) for key in want)  # clipping acted
    for rank, result in enumerate(results):
        long_context.assert_close(result["zero3_clip"]["state"], want, f"clipped rank {rank}")


@pytest.mark.parametrize("run", ["zero2_accumulate", "zero2_accumulate_tiled_logits"])
def test_accumulated_windows_train_like_one_process(two_ranks: Any, run: str) -> None:
    out, results = two_ranks
    want = long_context.reference(out / "pretrained", data_parallel=1, steps=2, accumulate=2)
    for rank, result in enumerate(results):
        long_context.assert_close(result[run]["state"], want, f"{run} rank {rank}")


def test_the_tiled_logits_loss_logs_the_loss_of_whole_logits(two_ranks: Any) -> None:
    """The chunked cross-entropy is the model's own loss: every logged value equals the untiled run's; the training
    steps' outputs held no logits (they never existed whole)."""
    _, results = two_ranks
    for result in results:
        assert result["zero3_tiled_logits"]["losses"] == pytest.approx(result["zero3"]["losses"], rel=0, abs=1e-6)
        assert result["zero3"]["had_logits"] == [True, True]
        for run in ("zero3_tiled_logits", "zero2_accumulate_tiled_logits", "zero3_tiled_logits_data_parallel"):
            assert not any(result[run]["had_logits"]), run


def test_the_tiled_logits_loss_without_sequence_parallelism_trains_like_one_process(two_ranks: Any) -> None:
    """2 data-parallel ranks, whole sequences, the loss over chunks of 5 tokens, ZeRO-3."""
    out, results = two_ranks
    want = long_context.reference(out / "pretrained", data_parallel=2, steps=2)
    for rank, result in enumerate(results):
        long_context.assert_close(result["zero3_tiled_logits_data_parallel"]["state"], want, f"rank {rank}")


def test_every_rank_logs_the_loss_of_the_whole_micro_batch(two_ranks: Any) -> None:
    out, results = two_ranks
    model, data = long_context.load(out / "pretrained"), long_context.PaddedTokens()
    first = results[0]["zero2"]["losses"][0]
    assert [result["zero2"]["losses"][0] for result in results] == [first, first]
    from _support.models import rank_batches

    (rows,) = rank_batches(long_context.SAMPLES, 1, long_context.BATCH, epoch=0)[0]
    batch = long_context.collate(data, rows)
    assert first == pytest.approx(float(model(**batch).loss.detach()), abs=1e-6)


def test_a_resumed_run_trains_like_one_process_and_exports_its_weights(two_ranks: Any) -> None:
    """1 step saved, a new Trainer resumes it mid-epoch (the sampler over the data-parallel groups) to step 2."""
    out, results = two_ranks
    want = long_context.reference(out / "pretrained", data_parallel=1, steps=2)
    for rank, result in enumerate(results):
        long_context.assert_close(result["zero3_resume"]["state"], want, f"resumed rank {rank}")
    long_context.assert_close(load_file(out / "export" / "model.safetensors"), want, "export")


def test_validation_logs_the_loss_of_whole_sequences(two_ranks: Any) -> None:
    out, results = two_ranks
    trained = long_context.load(out / "export")
    data = long_context.PaddedTokens()
    losses = []
    for start in range(0, long_context.SAMPLES, long_context.BATCH):
        rows = list(range(start, start + long_context.BATCH))
        losses.append(float(trained(**long_context.collate(data, rows)).loss.detach()))
    for result in results:
        assert result["zero3_resume"]["val_loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-6)


@pytest.mark.parametrize(
    ("run", "expected"),
    [
        (
            "generate",
            "LlamaForCausalLM.generate() cannot run while the model trains with sequence_parallel_size > 1: decoding "
            "adds one token at a time, which cannot be split over the group's ranks. Generate after the run (fit, "
            "validate, test) has ended, or with the exported weights in a run without sequence parallelism.",
        ),
        (
            "own_loss",
            "The loss given to backward was not computed by the model from the batch lightspeed split: with "
            "sequence_parallel_size > 1 each rank holds a slice of every sequence, with labels already shifted over "
            "the whole sequence, and only the model's own loss (`model(**batch).loss`) adds the slices up to the loss "
            "of whole sequences. Return that loss (scale or add to it as you like).",
        ),
        (
            "rank_rows",
            "ranks [0, 1] form one sequence-parallel group and must split the same rows, but their batches differ "
            "(rank 0: 2 rows x 31 positions, rank 1: 2 rows x 31 positions; where the shapes agree, the tokens or "
            "labels differ). lightspeed's sampler gives a group's ranks the same rows; an IterableDataset or a sampler "
            "of your own that splits by global rank does not: split the data by data-parallel group instead (part "
            "rank // sequence_parallel_size of world_size // sequence_parallel_size), shuffled with the same seed on "
            "every rank.",
        ),
        (
            "bad_world",
            "sequence_parallel_size=4 splits the world into groups of 4 ranks, but the run has 2 process(es): use a "
            "number of devices x nodes divisible by 4.",
        ),
        (
            "one_head",
            "sequence_parallel_size=2 splits attention heads over the group's ranks, and LlamaForCausalLM has 1 "
            "attention heads and 1 key/value heads: the attention heads must divide by 2, and the key/value heads by "
            "2 (or 2 by them).",
        ),
        (
            "eager",
            "sequence parallelism replaces the model's attention function, and LlamaForCausalLM uses "
            "attn_implementation='eager', which needs a whole attention mask. Build it with "
            "attn_implementation='sdpa' (on the CPU) or a flash-attention variant (on CUDA).",
        ),
    ],
)
def test_what_cannot_be_split_is_one_error_on_every_rank_before_the_first_step(
    two_ranks: Any, run: str, expected: str
) -> None:
    _, results = two_ranks
    assert [result[run] for result in results] == [f"SequenceParallelError: {expected}"] * 2


def test_gathered_metrics_over_sliced_sequences_equal_one_process_on_whole_ones(two_ranks: Any) -> None:
    """GatherForMetrics puts each sequence's slices back together and counts the group's rows once: token accuracy
    and the counts behind it equal one plain process over the same rows (31 positions: the pad added to split was
    cut)."""
    out, results = two_ranks
    want = long_context.token_scores(long_context.load(out / "pretrained"), rows=long_context.SAMPLES - 1)
    for result in results:
        got = {name: float(value) for name, value in result["gather_metrics"].items()}
        assert got == pytest.approx({f"val/{name}": value for name, value in want.items()}, rel=0, abs=1e-6)


def test_one_value_per_sequence_computed_from_a_slice_is_refused_on_every_rank(two_ranks: Any) -> None:
    _, results = two_ranks
    expected = (
        "StepOutputError: gather_for_metrics: ranks 0, 1: GatherForMetrics: data['preds'] is [2], and with "
        "sequence_parallel_size=2 each rank's step sees 16 of the 31 positions of its 2 sequences: return per-token "
        "predictions and targets of the slice ([2, 16, ...], e.g. logits.argmax(-1) and batch['shift_labels']), which "
        "lightspeed puts back into whole sequences; a value per sequence computed from a slice would be wrong."
    )
    assert [result["gather_per_sequence"] for result in results] == [expected] * 2


def test_evaluating_after_fit_a_model_configure_model_built_again_is_an_error(two_ranks: Any) -> None:
    """The engine fit trained would run new, untrained parameters: refused (ZeRO-2, where nothing else fails)."""
    _, results = two_ranks
    expected = (
        "ModelChangedError: CausalLM holds other parameters than the ones fit trained, so validate would not evaluate "
        "the trained weights. Lightning calls configure_model again for every stage: return early when the model "
        "already exists (`if getattr(self, 'model', None) is not None: return`)."
    )
    assert [result["rebuilt"] for result in results] == [expected] * 2


@pytest.mark.parametrize("run", ["zero3"])  # ZeRO-2 with sequence parallelism: the one-group tests above
def test_two_groups_of_two_train_like_one_process_on_whole_sequences(tmp_path: Path, run: str) -> None:
    """... and evaluate like one: the gathered metrics count each group's rows once, in order, without the row the
    sampler repeated to even out the groups (ZeRO-3: every rank's step runs the partitioned model)."""
    runs = [run, "gather_metrics"] if run == "zero3" else [run]
    results = _launch(tmp_path, 4, runs)
    want = long_context.reference(tmp_path / "pretrained", data_parallel=2, steps=2)
    for rank, result in enumerate(results):
        long_context.assert_close(result[run]["state"], want, f"{run} rank {rank}")
    if run == "zero3":
        scores = long_context.token_scores(long_context.load(tmp_path / "pretrained"), rows=long_context.SAMPLES - 1)
        for result in results:
            got = {name: float(value) for name, value in result["gather_metrics"].items()}
            assert got == pytest.approx({f"val/{name}": value for name, value in scores.items()}, rel=0, abs=1e-6)
