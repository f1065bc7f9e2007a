"""``batch_fingerprint``: what a sequence-parallel group compares before splitting a batch: equal for equal batches
(on any rank), different when one token, one label, the order of rows or the shape differs."""

from __future__ import annotations

import pytest
import torch

from lightspeed.core.sequence_parallel.agreement import batch_fingerprint

IDS = torch.tensor([[5, 6, 7, 8, 9], [3, 4, 2, 0, 0]])
LABELS = torch.tensor([[-100, 6, 7, 8, 9], [-100, 4, 2, -100, -100]])


def _changed(name: str) -> dict[str, torch.Tensor]:
    ids, labels = IDS.clone(), LABELS.clone()
    if name == "one token":
        ids[1, 0] = 4
    elif name == "one label":
        labels[0, 1] = -100
    elif name == "rows swapped":
        ids, labels = ids.flip(0), labels.flip(0)
    elif name == "tokens swapped":
        ids[0, 0], ids[0, 1] = int(ids[0, 1]), int(ids[0, 0])
    elif name == "a pad more":
        ids, labels = torch.cat([ids, torch.zeros(2, 1, dtype=ids.dtype)], 1), torch.cat([labels, labels[:, -1:]], 1)
    elif name == "no labels":
        return {"input_ids": ids}
    return {"input_ids": ids, "labels": labels}


def test_equal_batches_have_equal_fingerprints() -> None:
    first = batch_fingerprint({"input_ids": IDS, "labels": LABELS})
    again = batch_fingerprint({"input_ids": IDS.clone(), "labels": LABELS.clone(), "meta": "ignored"})
    assert torch.equal(first, again)
    assert first[:2].tolist() == [2, 5]


CHANGES = ["one token", "one label", "rows swapped", "tokens swapped", "a pad more", "no labels"]


@pytest.mark.parametrize("change", CHANGES)
def test_a_batch_that_differs_anywhere_has_another_fingerprint(change: str) -> None:
    assert not torch.equal(batch_fingerprint({"input_ids": IDS, "labels": LABELS}), batch_fingerprint(_changed(change)))


def test_every_token_of_a_large_vocabulary_counts() -> None:
    """Ids near 2**17 and 4096 positions: no term cancels another (int64 sums wrap the same way on every rank)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 150_000, (2, 4096), generator=generator)
    other = ids.clone()
    other[1, 4095] += 1
    assert not torch.equal(batch_fingerprint({"input_ids": ids}), batch_fingerprint({"input_ids": other}))
