"""``shard_batch``: each rank's slice of a right-padded causal-LM batch; the slices put back together are the whole
sequence with its labels shifted once, its positions and the real targets counted over the whole micro-batch; what
sequence parallelism cannot keep exact is one clear error."""

from __future__ import annotations

import pytest
import torch

from lightspeed.core.errors import SequenceParallelError
from lightspeed.core.sequence_parallel import shard_batch

IDS = torch.tensor([[5, 6, 7, 8, 9], [3, 4, 2, 0, 0]])
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
LABELS = torch.tensor([[-100, 6, 7, 8, 9], [-100, 4, 2, -100, -100]])


@pytest.mark.parametrize("size", [2, 3, 5])
def test_the_slices_of_every_rank_are_the_padded_sequence_with_labels_shifted_once(size: int) -> None:
    batch = {"input_ids": IDS, "attention_mask": MASK, "labels": LABELS, "meta": "kept"}
    slices = [shard_batch(batch, rank, size, pad_token_id=0) for rank in range(size)]
    padded = -(-5 // size) * size
    ids = torch.cat([part["input_ids"] for part in slices], dim=1)
    assert torch.equal(ids[:, :5], IDS) and torch.equal(ids[:, 5:], torch.zeros(2, padded - 5, dtype=IDS.dtype))
    positions = torch.cat([part["position_ids"] for part in slices], dim=1)
    assert torch.equal(positions, torch.arange(padded).expand(2, -1))
    shifted = torch.cat([part["shift_labels"] for part in slices], dim=1)
    expected = torch.full((2, padded), -100)
    expected[:, :4] = LABELS[:, 1:]  # the target of position t is the label of t + 1, over the whole sequence
    assert torch.equal(shifted, expected)
    for part in slices:
        assert part["labels"] is part["shift_labels"]
        assert int(part["num_items_in_batch"]) == 6  # 4 + 2 real targets in the whole micro-batch
        assert part["meta"] == "kept" and "attention_mask" not in part


def test_a_batch_without_labels_is_sliced_without_a_loss() -> None:
    part = shard_batch({"input_ids": IDS}, 1, 5)
    assert torch.equal(part["input_ids"], IDS[:, 1:2]) and torch.equal(part["position_ids"], torch.tensor([[1], [1]]))
    assert set(part) == {"input_ids", "position_ids"}


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (
            (IDS, LABELS),
            "sequence_parallel_size > 1 splits a batch along its sequence and needs it as a mapping with 'input_ids' "
            "(and 'labels'), as HuggingFace collators make it; got a tuple.",
        ),
        (
            {"ids": IDS},
            "sequence_parallel_size > 1 splits a batch along its sequence and needs it as a mapping with 'input_ids' "
            "(and 'labels'), as HuggingFace collators make it; got a mapping with keys ['ids'].",
        ),
        (
            {"input_ids": IDS[0]},
            "sequence_parallel_size > 1 needs batch['input_ids'] as a [batch, sequence] tensor; got (5,).",
        ),
        (
            {"input_ids": IDS, "labels": LABELS[:, :4]},
            "batch['labels'] has 4 positions but input_ids has 5: they must be the same sequence to be split together.",
        ),
        (
            {"input_ids": IDS, "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])},
            "sequence parallelism attends causally over the whole sequence and ignores attention_mask, so padding "
            "must be on the right (a real token after a pad would attend to it). Pad on the right "
            "(tokenizer.padding_side = 'right'), and do not pack several documents into one sequence.",
        ),
        (
            {"input_ids": IDS, "position_ids": torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])},
            "batch['position_ids'] is not 0, 1, 2, ... in every row (packed sequences or left padding): sequence "
            "parallelism cannot keep documents apart. Leave position_ids out (lightspeed adds them) and pad on the "
            "right.",
        ),
        (
            {"input_ids": IDS, "token_type_ids": torch.zeros_like(IDS)},
            "batch key(s) ['token_type_ids'] have the sequence dimension too, and sequence parallelism splits only "
            "input_ids, labels, attention_mask, position_ids: leave them out of the batch, or compute what needs "
            "them inside the model.",
        ),
    ],
    ids=["tuple", "no-input-ids", "one-dimensional", "lengths-differ", "left-padded", "packed", "other-sequence"],
)
def test_what_cannot_be_split_exactly_is_a_clear_error(batch: object, message: str) -> None:
    with pytest.raises(SequenceParallelError) as caught:
        shard_batch(batch, 0, 2)
    assert str(caught.value) == message


def test_plain_positions_given_by_the_collator_are_accepted() -> None:
    batch = {"input_ids": IDS, "position_ids": torch.arange(5).expand(2, -1)}
    assert torch.equal(shard_batch(batch, 1, 2)["position_ids"], torch.tensor([[3, 4, 5], [3, 4, 5]]))
