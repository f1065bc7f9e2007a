"""``count_samples``: how many samples a batch holds, the weight of a mean-loss micro-batch in exact accumulation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightspeed.core.common.batch import count_samples


@dataclasses.dataclass
class _Batch:
    name: str
    tokens: torch.Tensor


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        (torch.zeros(5, 2), 5),
        ({"ids": torch.zeros(3, 7), "mask": torch.zeros(3, 7)}, 3),
        (("text", [torch.zeros(4)]), 4),
        (_Batch("x", torch.zeros(6, 2)), 6),
        (torch.tensor(1.0), None),
        (["a", 3], 2),  # a list of plain objects: one sample each
        ({"meta": "x"}, None),  # nothing with a sample dimension
    ],
)
def test_count_samples_reads_the_first_batch_dimension(batch, expected):
    assert count_samples(batch) == expected


def test_a_nested_tensor_counts_its_components():
    ragged = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(5), torch.zeros(1)])
    assert count_samples({"tokens": ragged}) == 3
