"""Single-process tests of issue #12's building blocks: shard_iterable's shares, finding a nested
DistributedSampler, the per-item batch sizes of a BatchSampler, and the first-batch fingerprint."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, SequentialSampler

import lightspeed
from lightspeed.core.gather.accounting import GatherState, batch_fingerprint, find_distributed_sampler
from lightspeed.core.gather.sharding import ShardedIterable

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from gather_data import MapData  # noqa: E402


class Numbers(IterableDataset):
    def __init__(self, n: int, with_len: bool = True) -> None:
        self.n, self.with_len = n, with_len

    def __iter__(self):
        yield from range(self.n)

    def __len__(self) -> int:
        if not self.with_len:
            raise TypeError("no length")
        return self.n


def test_public_names():
    assert lightspeed.track is lightspeed.core.gather.track
    assert lightspeed.shard_iterable is lightspeed.core.gather.shard_iterable
    assert {"track", "shard_iterable"} <= set(lightspeed.__all__)


@pytest.mark.parametrize("n", [0, 1, 5, 7, 9])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_shares_are_round_robin_padded_to_equal_length(n, world):
    shares = [list(ShardedIterable(Numbers(n), rank=r, world_size=world)) for r in range(world)]
    assert len(ShardedIterable(Numbers(n), rank=0, world_size=world)) == n
    for rank, share in enumerate(shares):
        real = list(range(rank, n, world))
        assert share[: len(real)] == real
        assert len(share) == -(-n // world)  # every rank runs the same number of samples
        assert share[len(real) :] == [0] * (len(share) - len(real))  # padded with the stream's first sample


def test_without_a_length_nothing_is_padded_and_len_says_how_to_fix():
    shard = ShardedIterable(Numbers(5, with_len=False), rank=1, world_size=3)
    assert list(shard) == [1, 4]
    with pytest.raises(TypeError, match=r"has no total length .* pass length=\.\.\.$"):
        len(shard)
    assert list(ShardedIterable(Numbers(5, with_len=False), length=5, rank=1, world_size=3)) == [1, 4]
    assert list(ShardedIterable(Numbers(5, with_len=False), length=5, rank=2, world_size=3)) == [2, 0]


def test_workers_take_whole_batches_in_turn_and_the_loader_yields_them_in_order():
    loader = DataLoader(lightspeed.shard_iterable(Numbers(23), batch_size=3), batch_size=3, num_workers=2)
    assert torch.cat(list(loader)).tolist() == list(range(23))  # one process: rank 0 of 1


def test_workers_without_batch_size_is_an_error():
    loader = DataLoader(lightspeed.shard_iterable(Numbers(6)), batch_size=2, num_workers=2)
    with pytest.raises(ValueError, match=r"the DataLoader runs 2 workers; pass shard_iterable\(dataset, batch_size="):
        list(loader)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"shard_iterable\(length=-1\): the total number of samples must be >= 0"):
        lightspeed.shard_iterable(Numbers(3), length=-1)
    with pytest.raises(ValueError, match=r"shard_iterable\(batch_size=0\): must be >= 1"):
        lightspeed.shard_iterable(Numbers(3), batch_size=0)


class Wrapper:
    """A batch sampler wrapper that names what it wraps ``base_sampler``."""

    def __init__(self, inner) -> None:
        self.base_sampler = inner


def test_distributed_sampler_found_through_any_nesting():
    ds = MapData(10)
    dist_sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=False)
    batches = BatchSampler(dist_sampler, batch_size=4, drop_last=False)
    assert find_distributed_sampler(DataLoader(ds, batch_size=None, sampler=batches)) is dist_sampler
    assert find_distributed_sampler(DataLoader(ds, batch_sampler=Wrapper(Wrapper(batches)))) is dist_sampler
    assert find_distributed_sampler(DataLoader(ds, batch_size=2)) is None
    plain = BatchSampler(SequentialSampler(ds), batch_size=2, drop_last=False)
    assert find_distributed_sampler(DataLoader(ds, batch_sampler=Wrapper(plain))) is None


def test_distributed_sampler_around_one_that_shards_already_is_an_error():
    lightning = pytest.importorskip("lightning.fabric.utilities.distributed")
    ds = MapData(10)
    inner = BatchSampler(DistributedSampler(ds, num_replicas=2, rank=0), batch_size=2, drop_last=False)
    outer = lightning.DistributedSamplerWrapper(inner, num_replicas=2, rank=0)
    with pytest.raises(
        ValueError,
        match=r"holds a DistributedSampler already, so the data is sharded twice; .*"
        r"use_distributed_sampler=False",
    ):
        find_distributed_sampler(DataLoader(ds, batch_size=None, sampler=outer))


@pytest.mark.parametrize("drop_last", [False, True])
def test_item_sizes_come_from_the_batch_sampler_given_as_sampler(drop_last):
    ds = MapData(22)
    sampler = BatchSampler(DistributedSampler(ds, num_replicas=3, rank=2), batch_size=3, drop_last=drop_last)
    state = GatherState.from_dataloader(DataLoader(ds, batch_size=None, sampler=sampler), rank=2, world_size=3)
    assert state.item_sizes == (3, 8, drop_last)
    sizes = []
    for _ in range(4):
        sizes.append(state.item_size(object()))  # not counted from the batch: an object has no sample count
        state.begin_batch(sizes[-1])
    assert sizes == ([3, 3, 0, 0] if drop_last else [3, 3, 2, 0])
    assert [len(b) for b in sampler] == [s for s in sizes if s]


def test_fingerprint_is_zero_for_trivial_batches_and_content_sensitive_otherwise():
    assert batch_fingerprint(torch.ones(4, 3)) == 0  # constant rows
    assert batch_fingerprint(torch.arange(1)) == 0  # a single row
    assert batch_fingerprint({"text": ["a", "a"], "x": torch.zeros(2)}) == 0
    first = batch_fingerprint((torch.arange(4), torch.zeros(4)))
    assert first != 0 and first == batch_fingerprint((torch.arange(4), torch.zeros(4)))
    assert first != batch_fingerprint((torch.arange(1, 5), torch.zeros(4)))
    assert batch_fingerprint({"text": ["a", "b"]}) not in (0, batch_fingerprint({"text": ["a", "c"]}))


def test_replicated_rule():
    state = GatherState.shards(rank=0, world_size=3)
    state.dataset_kind = "iterable"
    assert state.replicated_problem([5, 5, 5]) is not None
    assert state.replicated_problem([5, 5, 6]) is None  # only when every rank's first batch is the same
    assert state.replicated_problem([0, 0, 0]) is None  # trivial batches say nothing
    assert state.replicated_problem([5]) is None


def test_single_process_gathers_return_the_data_unchanged():
    nested = torch.nested.nested_tensor([torch.arange(2), torch.arange(3)])
    assert lightspeed.gather_for_metrics(nested) is nested
    assert lightspeed.pad_across_processes(nested) is nested
