"""BatchWindow and its helpers in one process: splitting gathered windows back per batch, sizing the next window.

The multi-process behaviour (windows of two batches equal per-batch gathers, on 2 and 3 gloo ranks) is in
tests/core/gather/test_gather_distributed.py; the callback's windows in
tests/callbacks/test_gather_for_metrics_distributed.py.
"""

from __future__ import annotations

import pytest
import torch

from lightspeed.core.errors import GatherError
from lightspeed.core.gather.accounting import GatherState
from lightspeed.core.gather.window import BatchWindow, batches_for_budget, batches_per_window, row_bytes, split_by_batch


def test_split_regroups_rank_by_rank_results_by_batch_keeping_order_within_a_batch():
    # two ranks' shards come back rank by rank: rank 0's batches 0, 1 then rank 1's batches 0, 1
    numbers = torch.tensor([0, 0, 1, 0, 0, 1], dtype=torch.int32)
    values = torch.tensor([10, 11, 12, 20, 21, 22])
    names = ["a", "b", "c", "d", "e", "f"]
    batches = split_by_batch({"v": values, "n": names}, numbers)
    assert [b["v"].tolist() for b in batches] == [[10, 11, 20, 21], [12, 22]]
    assert [b["n"] for b in batches] == [["a", "b", "d", "e"], ["c", "f"]]


def test_split_of_ordered_numbers_keeps_rows_and_skips_batches_without_rows():
    numbers = torch.tensor([0, 0, 2, 2, 2], dtype=torch.int32)  # batch 1 was only padding
    batches = split_by_batch({"v": torch.arange(5)}, numbers)
    assert [b["v"].tolist() for b in batches] == [[0, 1], [2, 3, 4]]
    assert split_by_batch({"v": torch.zeros(0)}, torch.zeros(0, dtype=torch.int32)) == []


def test_window_size_follows_the_bytes_a_batch_carried_per_rank():
    # 2 batches over 2 ranks, 4 int64 rows + 4 float32 rows per global batch: 48 bytes per global batch, 24 per rank
    gathered = [{"p": torch.zeros(4, dtype=torch.int64), "t": torch.zeros(4)} for _ in range(2)]
    assert batches_per_window(1000, gathered, world_size=2, batches=2) == 32, "1000 / 24 = 41 -> the power of two below"
    assert batches_per_window(10, gathered, world_size=2, batches=2) == 1, "never less than one batch"
    assert batches_per_window(1000, [], world_size=2, batches=1) == 512, "empty windows count as one byte per batch"


def test_budget_rounds_down_to_a_power_of_two_so_close_estimates_agree():
    assert [batches_for_budget(4096, b) for b in (4096, 2048, 1500, 1025, 1024, 5000)] == [1, 2, 2, 2, 4, 1]
    assert batches_for_budget(4 * 2**20, 16 * 1000) == 256


def test_row_bytes_counts_trailing_dims_and_objects():
    outputs = {"logits": torch.zeros(5, 3, 2), "labels": torch.zeros(5, dtype=torch.int64), "names": ["a"] * 5}
    assert row_bytes(outputs) == 4 * 3 * 2 + 8 + 64


def test_single_process_window_returns_each_batch_as_added():
    state = GatherState.strided(5, rank=0, world_size=1)
    window = BatchWindow(first_sample=0)
    for rows in (2, 2, 1):
        state.begin_batch(rows)
        window.add(
            {
                "p": torch.arange(state.batch_start, state.seen),
                "n": [f"s{i}" for i in range(state.batch_start, state.seen)],
            }
        )
    assert window.batches == 3
    batches = window.gather(state)
    assert [b["p"].tolist() for b in batches] == [[0, 1], [2, 3], [4]]
    assert [b["n"] for b in batches] == [["s0", "s1"], ["s2", "s3"], ["s4"]]


def test_window_refuses_outputs_that_cannot_be_concatenated():
    window = BatchWindow(first_sample=0)
    window.add({"p": torch.zeros(2, 3)})
    assert window.fits({"p": torch.ones(4, 3)})
    assert not window.fits({"p": torch.zeros(2, 4)}), "another trailing shape"
    assert not window.fits({"p": torch.zeros(2, 3, dtype=torch.float64)}), "another dtype"
    assert not window.fits({"q": torch.zeros(2, 3)}), "another name"
    with pytest.raises(ValueError, match=r"do not fit the window; gather it first"):
        window.add({"p": torch.zeros(2, 4)})
    with pytest.raises(ValueError, match=r"holds no batch"):
        BatchWindow(first_sample=0).gather(GatherState.strided(1, rank=0, world_size=1))


def test_a_failed_batch_raises_at_the_windows_gather_as_the_given_type():
    class Missing(GatherError):
        pass

    state = GatherState.strided(4, rank=0, world_size=1)
    window = BatchWindow(first_sample=0)
    state.begin_batch(2)
    window.add({"p": torch.zeros(2)})
    state.begin_batch(2)
    window.fail("step 2 returned nothing.")
    window.fail("a later problem is not the one reported.")
    assert window.batches == 3
    with pytest.raises(Missing, match=r"^step 2 returned nothing\.$"):
        window.gather(state, error_type=Missing)
