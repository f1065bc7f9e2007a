"""``lightspeed.xla.pad_to_bucket`` and ``bucket_collate``: plain PyTorch (no torch_xla), so they run in the main
suite. Padded values, attention masks, per-name pad values, container types, and the errors for bad input."""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict, namedtuple

import pytest
import torch
from torch.utils.data import DataLoader

import lightspeed
from lightspeed.xla import bucket_collate, pad_to_bucket

BUCKETS = (4, 8, 16)


def _batch(length: int, batch_size: int = 2) -> dict[str, torch.Tensor]:
    ids = torch.arange(1, batch_size * length + 1).reshape(batch_size, length)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(batch_size, length, dtype=torch.long),
        "labels": ids + 100,
        "score": torch.tensor([0.5, 1.5][:batch_size]),  # (batch,): no sequence dimension, left alone
    }


def test_public_name() -> None:
    assert lightspeed.xla.pad_to_bucket is pad_to_bucket
    assert "xla" in lightspeed.__all__


@pytest.mark.parametrize(("length", "bucket"), [(1, 4), (4, 4), (5, 8), (8, 8), (9, 16), (16, 16)])
def test_the_smallest_bucket_that_holds_the_batch_is_chosen(length: int, bucket: int) -> None:
    padded = pad_to_bucket(_batch(length), BUCKETS)
    assert padded["input_ids"].shape == (2, bucket)
    assert padded["attention_mask"].shape == (2, bucket)
    assert padded["labels"].shape == (2, bucket)


def test_values_masks_and_labels_are_padded_with_their_own_values() -> None:
    batch = _batch(3)
    padded = pad_to_bucket(batch, BUCKETS, pad_value=7)
    assert padded["input_ids"].tolist() == [[1, 2, 3, 7], [4, 5, 6, 7]]  # pad_value
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 0]]  # 0: padding is masked out
    assert padded["labels"].tolist() == [[101, 102, 103, -100], [104, 105, 106, -100]]  # ignored by the loss
    assert padded["score"] is batch["score"]
    assert padded["input_ids"].dtype == torch.long and padded["attention_mask"].dtype == torch.long
    assert batch["input_ids"].shape == (2, 3)  # the input batch is unchanged


def test_pad_values_by_name_override_the_defaults() -> None:
    padded = pad_to_bucket(_batch(3), BUCKETS, pad_values={"labels": 0, "input_ids": 9})
    assert padded["labels"][:, -1].tolist() == [0, 0]
    assert padded["input_ids"][:, -1].tolist() == [9, 9]
    assert padded["attention_mask"][:, -1].tolist() == [0, 0]


def test_a_batch_already_at_a_bucket_length_keeps_its_tensors() -> None:
    batch = _batch(8)
    padded = pad_to_bucket(batch, BUCKETS)
    assert padded is not batch
    assert all(padded[key] is batch[key] for key in batch)


def test_floating_tensors_along_dim_1_of_three_dimensional_inputs() -> None:
    embeddings = torch.ones(2, 5, 3)
    padded = pad_to_bucket({"inputs_embeds": embeddings, "attention_mask": torch.ones(2, 5)}, BUCKETS)
    assert padded["inputs_embeds"].shape == (2, 8, 3)
    assert torch.equal(padded["inputs_embeds"][:, :5], embeddings)
    assert padded["inputs_embeds"][:, 5:].abs().sum() == 0
    assert padded["attention_mask"].sum() == 10


def test_another_sequence_dimension() -> None:
    padded = pad_to_bucket(torch.ones(2, 3, 5), BUCKETS, dim=2, pad_value=-1.0)
    assert padded.shape == (2, 3, 8)
    assert padded[..., 5:].unique().tolist() == [-1.0]


def test_keys_pick_the_tensors_to_pad() -> None:
    batch = {"input_ids": torch.ones(2, 5, dtype=torch.long), "pixels": torch.ones(2, 3)}
    padded = pad_to_bucket(batch, BUCKETS, keys=["input_ids"])
    assert padded["input_ids"].shape == (2, 8)
    assert padded["pixels"] is batch["pixels"]


Pair = namedtuple("Pair", ["ids", "labels"])


@dataclasses.dataclass
class _Batch:
    tokens: torch.Tensor
    name: str


def test_containers_keep_their_types() -> None:
    tuple_batch = pad_to_bucket((torch.ones(2, 3), torch.zeros(2)), BUCKETS)
    assert type(tuple_batch) is tuple and tuple_batch[0].shape == (2, 4) and tuple_batch[1].shape == (2,)
    assert pad_to_bucket(torch.ones(2, 3), BUCKETS).shape == (2, 4)
    pair = pad_to_bucket(Pair(torch.ones(2, 3), torch.ones(2, 3)), BUCKETS)
    assert type(pair) is Pair and pair.labels[:, -1].tolist() == [-100, -100]  # named: labels
    ordered = pad_to_bucket(OrderedDict(ids=torch.ones(2, 3)), BUCKETS)
    assert type(ordered) is OrderedDict and ordered["ids"].shape == (2, 4)
    nested = pad_to_bucket([{"ids": torch.ones(2, 3)}, "meta"], BUCKETS)
    assert nested[0]["ids"].shape == (2, 4) and nested[1] == "meta"
    data = pad_to_bucket(_Batch(torch.ones(2, 3), "x"), BUCKETS)
    assert type(data) is _Batch and data.tokens.shape == (2, 4) and data.name == "x"


def _raises(error: type[Exception], message: str):
    return pytest.raises(error, match=f"^{re.escape(message)}$")


def test_a_sequence_longer_than_the_largest_bucket_says_what_to_change() -> None:
    with _raises(
        ValueError,
        "A sequence of length 17 is longer than the largest bucket 16 (buckets=(4, 8, 16)). Add a bucket of at least"
        " 17 to `buckets`, or truncate the sequences to at most 16 tokens (for a Hugging Face tokenizer:"
        " truncation=True, max_length=16).",
    ):
        pad_to_bucket(_batch(17), BUCKETS)


def test_empty_buckets() -> None:
    with _raises(ValueError, "buckets is empty: pass the sequence lengths to pad to, e.g. buckets=(128, 256, 512)."):
        pad_to_bucket(_batch(3), ())


def test_unsorted_buckets() -> None:
    with _raises(
        ValueError,
        "buckets must be strictly increasing, got buckets=(256, 128, 128): pass them sorted and without repeats,"
        " buckets=(128, 256).",
    ):
        pad_to_bucket(_batch(3), (256, 128, 128))


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "8"])
def test_buckets_that_are_not_positive_whole_numbers(bad: object) -> None:
    with _raises(
        ValueError,
        f"buckets must be positive whole numbers (sequence lengths), got {bad!r} in buckets={(4, bad)!r}.",
    ):
        pad_to_bucket(_batch(3), (4, bad))  # type: ignore[arg-type]


def test_buckets_that_are_not_a_sequence() -> None:
    with _raises(TypeError, "buckets must be a sequence of sequence lengths, e.g. buckets=(128, 256, 512), got 128."):
        pad_to_bucket(_batch(3), 128)  # type: ignore[arg-type]


def test_a_batch_with_nothing_to_pad() -> None:
    with _raises(
        ValueError,
        "Nothing to pad: the batch has no tensor with a sequence dimension 1 (batch['labels'] (8,)). pad_to_bucket"
        " pads a collated batch (tensors of shape (batch, sequence, ...)): call it on the output of the collate"
        " function, use lightspeed.xla.bucket_collate(...) as the DataLoader's collate_fn to pad samples, or set"
        " dim= to the sequence dimension.",
    ):
        pad_to_bucket({"labels": torch.zeros(8)}, BUCKETS)
    with pytest.raises(ValueError, match=r"^Nothing to pad: the batch has no tensor .* \(no tensors\)\. "):
        pad_to_bucket({"input_ids": [[1, 2], [3]]}, BUCKETS)


def test_tensors_that_disagree_on_the_sequence_length() -> None:
    with _raises(
        ValueError,
        "The tensors to pad disagree on the sequence length along dim 1: batch['input_ids'] 5, batch['pixels'] 3."
        " Pass keys=[...] naming the tensors that hold the sequence (the others are left as they are).",
    ):
        pad_to_bucket({"input_ids": torch.ones(2, 5), "pixels": torch.ones(2, 3)}, BUCKETS)


def test_keys_naming_no_tensor() -> None:
    with _raises(
        ValueError,
        "keys=['input_id'] names ['input_id'], which is not a tensor with a dimension 1 in the batch"
        " (batch['input_ids'] (2, 5)). Name tensors of the batch that hold the sequence along dim 1.",
    ):
        pad_to_bucket({"input_ids": torch.ones(2, 5)}, BUCKETS, keys=["input_id"])


@pytest.mark.parametrize("dim", [0, -1, 1.0])
def test_dim_must_be_a_sequence_dimension(dim: object) -> None:
    with _raises(
        ValueError,
        "dim must be the sequence dimension of the batch's tensors, an integer >= 1 (dim 0 is the batch dimension),"
        f" got dim={dim!r}.",
    ):
        pad_to_bucket(_batch(3), BUCKETS, dim=dim)  # type: ignore[arg-type]


def test_a_pad_value_that_does_not_fit_the_dtype() -> None:
    with _raises(
        ValueError,
        "The pad value -100 for batch['labels'] does not fit its dtype torch.uint8. Pass one that does, by the"
        " tensor's name in pad_values={name: value}, or as pad_value=... for every tensor.",
    ):
        pad_to_bucket({"labels": torch.ones(2, 3, dtype=torch.uint8)}, BUCKETS)
    with pytest.raises(ValueError, match=r"^The pad value 0\.5 for batch\['ids'\] does not fit its dtype torch\.int64"):
        pad_to_bucket({"ids": torch.ones(2, 3, dtype=torch.long)}, BUCKETS, pad_value=0.5)
    assert pad_to_bucket({"m": torch.ones(2, 3, dtype=torch.bool)}, BUCKETS)["m"].tolist() == [[True] * 3 + [False]] * 2


# ---- bucket_collate ----------------------------------------------------------------------------------------------


def test_collate_pads_samples_to_the_bucket_of_the_longest_and_adds_a_mask() -> None:
    samples = [
        {"input_ids": [5, 6, 7], "labels": [1, 2, 3], "label": 1},
        {"input_ids": torch.tensor([8, 9, 10, 11, 12]), "labels": torch.tensor([4, 5, 6, 7, 8]), "label": 0},
    ]
    batch = bucket_collate(BUCKETS, pad_value=3)(samples)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 3, 3, 3, 3, 3], [8, 9, 10, 11, 12, 3, 3, 3]]
    assert batch["labels"].tolist() == [[1, 2, 3, -100, -100, -100, -100, -100], [4, 5, 6, 7, 8, -100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    assert batch["attention_mask"].dtype == torch.long
    assert batch["label"].tolist() == [1, 0]


def test_collate_pads_an_existing_mask_with_zeros_and_tuples_get_none() -> None:
    samples = [
        {"ids": torch.ones(2), "attention_mask": torch.ones(2)},
        {"ids": torch.ones(3), "attention_mask": torch.ones(3)},
    ]
    assert bucket_collate(BUCKETS)(samples)["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    ids, target = bucket_collate(BUCKETS)([(torch.ones(2), torch.tensor(0)), (torch.ones(6), torch.tensor(1))])
    assert ids.shape == (2, 8) and target.tolist() == [0, 1]
    assert "attention_mask" not in bucket_collate(BUCKETS, mask_key=None)([{"ids": [1, 2]}])


def test_collate_in_a_dataloader_gives_bucket_shapes_only() -> None:
    lengths = [1, 3, 4, 5, 2, 9, 7, 6]
    data = [{"input_ids": list(range(1, n + 1))} for n in lengths]
    loader = DataLoader(data, batch_size=2, collate_fn=bucket_collate(BUCKETS))  # type: ignore[arg-type]
    shapes = [tuple(batch["input_ids"].shape) for batch in loader]
    assert shapes == [(2, 4), (2, 8), (2, 16), (2, 8)]  # longest 3, 5, 9, 7
    assert [int(m.sum()) for batch in loader for m in batch["attention_mask"]] == lengths


def test_collate_after_the_users_collate_function() -> None:
    def pad_to_longest(samples: list[list[int]]) -> dict[str, torch.Tensor]:
        longest = max(len(s) for s in samples)
        return {
            "input_ids": torch.tensor([s + [0] * (longest - len(s)) for s in samples]),
            "attention_mask": torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in samples]),
        }

    batch = bucket_collate(BUCKETS, collate_fn=pad_to_longest)([[1, 2], [3, 4, 5, 6, 7]])
    assert batch["input_ids"].tolist() == [[1, 2, 0, 0, 0, 0, 0, 0], [3, 4, 5, 6, 7, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]


def test_collate_errors() -> None:
    with _raises(ValueError, "buckets is empty: pass the sequence lengths to pad to, e.g. buckets=(128, 256, 512)."):
        bucket_collate(())  # checked when the DataLoader is built, not at the first batch
    collate = bucket_collate(BUCKETS)
    with _raises(
        ValueError,
        "A sequence of length 20 is longer than the largest bucket 16 (buckets=(4, 8, 16)). Add a bucket of at least"
        " 20 to `buckets`, or truncate the sequences to at most 16 tokens (for a Hugging Face tokenizer:"
        " truncation=True, max_length=16).",
    ):
        collate([{"ids": [1] * 3}, {"ids": [1] * 20}])
    with _raises(ValueError, "bucket_collate got no samples to collate (an empty batch)."):
        collate([])
    with _raises(
        ValueError,
        "Nothing to pad: the sample 0 has no tensor with a sequence dimension 0 (no tensors). bucket_collate pads"
        " samples whose sequences are tensors or lists of numbers; give each sample its sequence along dim 0, or set"
        " dim= (the batch's sequence dimension, the sample's plus one).",
    ):
        collate([{"text": "hello"}])
