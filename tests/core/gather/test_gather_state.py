"""Single-process tests of the sample accounting, padding and tree helpers behind gather_for_metrics."""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightspeed import gather_for_metrics, gather_object, pad_across_processes
from lightspeed.core.gather.accounting import (
    GatherState,
    batch_size_of,
    current_state,
    global_order,
    set_current_state,
)
from lightspeed.core.gather.api import end_of_dataloader, track
from lightspeed.core.gather.collective import TIMEOUT_ENV, gather_timeout
from lightspeed.core.gather.padding import pad_tensor
from lightspeed.core.gather.tree import flatten

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from gather_data import LengthIterable, MapData, ShardedIterable  # noqa: E402


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 5, 7, 8, 13])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_sampler_accounting_keeps_each_index_exactly_once(world, n, drop_last, shuffle):
    """Brute force: replay every rank's sampler; the first `real_samples` of each rank cover every index once."""
    ds = MapData(n)
    kept, everything = [], []
    for rank in range(world):
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=shuffle, drop_last=drop_last, seed=3)
        indices = list(sampler)
        state = GatherState.from_dataloader(DataLoader(ds, sampler=sampler), rank=rank, world_size=world)
        assert state.layout == "strided" and state.rank == rank
        kept += indices[: state.real_samples]
        everything += indices
    assert sorted(kept) == sorted(set(everything)), "every index exactly once"
    assert len(kept) == len(set(kept))
    if not drop_last:
        assert sorted(kept) == list(range(n))


def test_iterable_with_len_is_round_robin_over_the_total():
    n, world = 11, 3
    kept = []
    for rank in range(world):
        loader = DataLoader(LengthIterable(n, rank, world), batch_size=2)
        state = GatherState.from_dataloader(loader, rank=rank, world_size=world)
        assert (state.layout, state.total_samples, state.from_iterable_len) == ("strided", n, True)
        produced = [int(i) for _, _, idx in loader for i in idx]
        assert len(produced) == 4  # padded to ceil(11 / 3)
        kept += produced[: state.real_samples]
    assert sorted(kept) == list(range(n))


def test_iterable_without_len_counts_everything_as_real():
    state = GatherState.from_dataloader(
        DataLoader(ShardedIterable(10, 1, 3, padded=False), batch_size=2), rank=1, world_size=3
    )
    assert (state.layout, state.real_samples, state.total_samples) == ("shards", None, None)
    state.begin_batch(2)
    assert state.real_count(0, 1000) == 1000 and state.real_mask().tolist() == [True, True]


def test_map_dataset_without_distributed_sampler_warns_and_counts_shards():
    with pytest.warns(UserWarning, match="has a map-style dataset but no DistributedSampler"):
        state = GatherState.from_dataloader(DataLoader(MapData(5)), rank=0, world_size=2, name="dataloader 7")
    assert state.layout == "shards" and state.real_samples is None


def test_sampler_for_another_world_size_is_rejected():
    sampler = DistributedSampler(MapData(6), num_replicas=4, rank=0)
    with pytest.raises(
        ValueError, match=r"num_replicas=4 ranks but the process group has 2; create the sampler with num_replicas=2"
    ):
        GatherState.from_dataloader(DataLoader(MapData(6), sampler=sampler), rank=0, world_size=2)


@pytest.mark.parametrize("n", [6, 7, 8])
def test_sequence_parallel_groups_count_each_index_once_from_their_first_rank(n):
    """World 4 in 2 groups of 2 ranks (sequence parallelism): the sampler splits over the groups; only each group's
    first rank contributes, and what the contributors keep covers every index once."""
    ds = MapData(n)
    kept = []
    for rank in range(4):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank // 2, shuffle=False)
        state = GatherState.from_dataloader(
            DataLoader(ds, sampler=sampler), rank=rank, world_size=4, ranks_per_replica=2
        )
        assert (state.rank, state.world_size, state.contributes) == (rank // 2, 2, rank % 2 == 0)
        assert "2 groups of 2 ranks" in state.describe()
        indices = list(sampler)
        kept += indices[: state.real_count(0, len(indices))]
        assert not state.contributes or state.real_count(0, len(indices)) == len(range(rank // 2, n, 2))
    assert sorted(kept) == list(range(n))


def test_a_sequence_parallel_group_needs_a_sampler_over_the_groups():
    ds = MapData(7)
    wrong = DataLoader(ds, sampler=DistributedSampler(ds, num_replicas=4, rank=3))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "validate dataloader 0: its DistributedSampler has num_replicas=4, rank=3, but with "
            "sequence_parallel_size=2 this rank is in data-parallel group 1 of 2: create it with num_replicas=2, "
            "rank=1 (or let the strategy inject it)."
        ),
    ):
        GatherState.from_dataloader(wrong, rank=3, world_size=4, name="validate dataloader 0", ranks_per_replica=2)
    with pytest.raises(ValueError, match="has no DistributedSampler, and with sequence_parallel_size=2"):
        GatherState.from_dataloader(DataLoader(ds), rank=0, world_size=2, ranks_per_replica=2)


def test_gathered_rows_of_contributing_ranks_come_back_in_sampler_order():
    """Ranks 1 and 3 send no rows: positions of groups 0 and 1 interleave as the sampler laid them out."""
    assert global_order((4, 0, 3, 0), (0, 0, 0, 0), 4).tolist() == [0, 4, 1, 5, 2, 6, 3]
    assert global_order((2, 0, 2, 0), (1, 1, 0, 0), 4).tolist() == [2, 0, 3, 1]


def test_batches_positions_and_mask():
    state = GatherState.strided(10, rank=1, world_size=3)  # rank 1 owns positions 1, 4, 7 (real) and 10 (padding)
    assert state.real_samples == 3
    state.begin_batch(2)
    assert (state.batch_start, state.seen) == (0, 2) and state.real_mask().tolist() == [True, True]
    state.begin_batch(2)
    assert (state.batch_start, state.seen, state.batches) == (2, 4, 2)
    assert state.real_mask().tolist() == [True, False]
    assert state.start_for_rows(2) == 2  # the current batch
    assert state.start_for_rows(4) == 0  # everything so far this epoch
    assert state.start_for_rows(3) is None  # neither
    assert end_of_dataloader(state) == 3  # single process: this rank's real samples
    state.reset()
    assert (state.seen, state.batches, state.batch_size, state.real_total) == (0, 0, None, None)
    with pytest.raises(RuntimeError, match="no batch has started yet"):
        state.real_mask()


def test_single_process_is_a_no_op():
    data = {"preds": torch.arange(3), "names": ["a", "b", "c"], "loss": torch.tensor(1.0)}
    assert gather_for_metrics(data) is data
    assert pad_across_processes(data) is data
    assert gather_object({"k": 1}) == [{"k": 1}]


def test_track_keeps_the_state_current_and_counts_batches():
    loader = DataLoader(MapData(5), batch_size=2)
    set_current_state(None)
    sizes = []
    for _ in track(loader):
        sizes.append((current_state().batch_start, current_state().batch_size))
    assert sizes == [(0, 2), (2, 2), (4, 1)]
    assert current_state().seen == 5 and current_state().real_total == 5
    set_current_state(None)


def test_active_context_restores_the_previous_state():
    outer, inner = GatherState.shards(rank=0, world_size=1), GatherState.shards(rank=0, world_size=1)
    set_current_state(outer)
    with inner.active():
        assert current_state() is inner
    assert current_state() is outer
    set_current_state(None)


def test_batch_size_of():
    assert batch_size_of(torch.zeros(4, 2)) == 4
    assert batch_size_of({"meta": "x", "x": [torch.zeros(3)]}) == 3
    assert batch_size_of(["a", "b"]) == 2
    with pytest.raises(ValueError, match="cannot infer a batch size from a 0-d tensor"):
        batch_size_of(torch.tensor(1.0))


@pytest.mark.parametrize("pad_first", [False, True])
def test_pad_tensor(pad_first):
    t = torch.tensor([[1, 2], [3, 4]])
    out = pad_tensor(t, dim=1, size=4, pad_index=9, pad_first=pad_first)
    expected = [[9, 9, 1, 2], [9, 9, 3, 4]] if pad_first else [[1, 2, 9, 9], [3, 4, 9, 9]]
    assert out.tolist() == expected
    assert pad_tensor(torch.tensor([True]), 0, 3, pad_index=False).tolist() == [True, False, False]
    with pytest.raises(ValueError, match="cannot pad dim 0 of size 2 down to 1"):
        pad_tensor(t, 0, 1)


def test_flatten_rebuild_round_trip_keeps_container_types():
    Pair = collections.namedtuple("Pair", "a b")
    data = collections.OrderedDict(
        x=Pair(torch.zeros(2), [torch.ones(1), "tag"]), names=("p", "q"), n=3, s=torch.tensor(2.0)
    )
    leaves, rebuild = flatten(data)
    assert [leaf.kind for leaf in leaves] == ["tensor", "tensor", "object", "objects", "object", "scalar"]
    assert [leaf.path for leaf in leaves][:2] == ["data['x'][0]", "data['x'][1][0]"]
    out = rebuild([leaf.value for leaf in leaves])
    assert isinstance(out, collections.OrderedDict) and isinstance(out["x"], Pair) and isinstance(out["x"].b, list)
    assert out["names"] == ("p", "q") and out["n"] == 3 and torch.equal(out["s"], data["s"])


def test_gather_timeout_env(monkeypatch):
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert gather_timeout() == 300
    monkeypatch.setenv(TIMEOUT_ENV, "2.5")
    assert gather_timeout() == 2.5
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=r"LIGHTSPEED_GATHER_TIMEOUT='soon' is not a number of seconds"):
        gather_timeout()
    monkeypatch.setenv(TIMEOUT_ENV, "-1")
    with pytest.raises(ValueError, match=r"must be >= 0 seconds"):
        gather_timeout()
