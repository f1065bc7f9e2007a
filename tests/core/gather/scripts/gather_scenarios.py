"""Worker for tests/core/gather/test_gather_scenarios.py: peer-library (Accelerate) test scenarios on real gloo ranks.

``torchrun --nproc_per_node=W gather_scenarios.py OUT_DIR``: nested samplers (a DistributedSampler inside a
BatchSampler given as ``sampler=``, inside a custom batch sampler), ``shard_iterable`` (with and without DataLoader
workers), a plain loop over ``lightspeed.track``, and bad inputs (an unsharded stream, nested tensors, a dataloader
that is not the one the batch came from). Every rank saves ``rank{r}.pt``: per case what it gathered, or the error
message it got (every rank must get one, none may hang: LIGHTSPEED_GATHER_TIMEOUT bounds every wait).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torchmetrics
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gather_data import NUM_CLASSES, MapData, model  # noqa: E402

import lightspeed  # noqa: E402

SHUFFLE_SEED = 5


class BatchableData(MapData):
    """MapData that a BatchSampler given as ``sampler=`` indexes with a list of indices (``batch_size=None``)."""

    def __getitem__(self, i):
        if isinstance(i, list):
            return self.x[i], self.y[i], torch.tensor(i)
        return super().__getitem__(i)


class PassThroughBatches(Sampler):
    """A user's batch sampler that wraps another one under ``.batch_sampler`` (like Accelerate's SkipBatchSampler)."""

    def __init__(self, batch_sampler: BatchSampler) -> None:
        self.batch_sampler = batch_sampler

    def __iter__(self):
        yield from self.batch_sampler

    def __len__(self) -> int:
        return len(self.batch_sampler)


class WholeStream(IterableDataset):
    """Yields every sample of MapData(n) on every rank: not sharded. ``with_len``: ``__len__`` returns n."""

    def __init__(self, n: int) -> None:
        self.data = MapData(n)

    def __iter__(self):
        for i in range(len(self.data)):
            yield self.data[i]


class WholeStreamWithLen(WholeStream):
    def __len__(self) -> int:
        return len(self.data)


class ConstantShard(IterableDataset):
    """A correctly sharded stream whose samples are all identical (the same features everywhere): no false alarm."""

    def __init__(self, n: int, rank: int, world: int) -> None:
        self.own = len(range(rank, n, world))
        self.padded = -(-n // world)
        self.n = n

    def __iter__(self):
        for _ in range(self.padded):
            yield torch.ones(3)

    def __len__(self) -> int:
        return self.n


def catch(fn) -> str | None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return None


def gather_loop(loader) -> dict:
    """Per-batch and epoch-end gathers of the sample indices over ``lightspeed.track(loader)``."""
    per_batch, local = [], []
    for _, _, idx in lightspeed.track(loader):
        per_batch.append(lightspeed.gather_for_metrics(idx))
        local.append(idx)
    return {
        "per_batch": torch.cat(per_batch).tolist(),
        "epoch": lightspeed.gather_for_metrics(torch.cat(local)).tolist(),
    }


def good_cases(rank: int, world: int) -> dict:
    out: dict = {}
    ds = BatchableData(22)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for drop_last in (False, True):
            sampler = BatchSampler(
                DistributedSampler(ds, shuffle=True, seed=SHUFFLE_SEED), batch_size=4, drop_last=drop_last
            )
            loader = DataLoader(ds, batch_size=None, sampler=sampler)
            out[f"nested_sampler_drop{int(drop_last)}"] = gather_loop(loader)
        custom = PassThroughBatches(BatchSampler(DistributedSampler(ds, shuffle=False), batch_size=3, drop_last=False))
        out["custom_batch_sampler"] = gather_loop(DataLoader(MapData(22), batch_sampler=custom))
    out["warnings"] = [str(w.message) for w in caught if "DistributedSampler" in str(w.message)]

    out["shard_iterable"] = gather_loop(DataLoader(lightspeed.shard_iterable(WholeStreamWithLen(23)), batch_size=4))
    workers = DataLoader(lightspeed.shard_iterable(WholeStreamWithLen(23), batch_size=3), batch_size=3, num_workers=2)
    out["shard_iterable_workers"] = gather_loop(workers)
    out["shard_iterable_length"] = gather_loop(
        DataLoader(lightspeed.shard_iterable(WholeStream(11), length=11), batch_size=2)
    )

    # a sharded stream of constant data: every rank's first batch is the same, and that is no error
    constant = []
    for x in lightspeed.track(DataLoader(ConstantShard(7, rank, world), batch_size=2)):
        constant.append(lightspeed.gather_for_metrics(x))
    out["constant"] = torch.cat(constant).shape[0]

    # the plain loop of the README: 7 samples, a DistributedSampler, accuracy on the gathered predictions
    net = model()
    data = MapData(7)
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, shuffle=False))
    accuracy = torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro", sync_on_compute=False)
    by_name = torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro", sync_on_compute=False)
    with torch.no_grad():
        for x, y, _ in lightspeed.track(loader):
            preds, target = lightspeed.gather_for_metrics((net(x).argmax(-1), y))
            accuracy.update(preds, target)
            by_name.update(*lightspeed.gather_for_metrics((net(x).argmax(-1), y), dataloader=loader))
    out["plain_loop_acc"] = accuracy.compute()
    out["plain_loop_acc_dataloader_arg"] = by_name.compute()
    return out


def error_cases(rank: int, world: int) -> dict:
    out: dict = {}

    def unsharded(batch_size: int, with_len: bool) -> None:
        stream = WholeStreamWithLen(30) if with_len else WholeStream(30)
        for _, _, idx in lightspeed.track(DataLoader(stream, batch_size=batch_size)):
            lightspeed.gather_for_metrics(idx)

    out["unsharded_b4"] = catch(lambda: unsharded(4, True))
    out["unsharded_b30"] = catch(lambda: unsharded(30, True))
    out["unsharded_nolen"] = catch(lambda: unsharded(4, False))

    def unsharded_no_gather() -> None:  # the end-of-dataloader check carries the fingerprint too
        for _ in lightspeed.track(DataLoader(WholeStreamWithLen(30), batch_size=4)):
            pass

    out["unsharded_end_only"] = catch(unsharded_no_gather)

    def map_without_sampler() -> None:
        for _, _, idx in lightspeed.track(DataLoader(MapData(9), batch_size=3)):
            lightspeed.gather_for_metrics(idx)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["map_replicated"] = catch(map_without_sampler)

    nested = torch.nested.nested_tensor([torch.arange(2), torch.arange(3)])
    state = lightspeed.core.gather.GatherState.strided(2 * world, rank, world)
    state.begin_batch(2)
    x = nested if rank == 1 else torch.zeros(2, 3, dtype=torch.int64)
    out["nested_gather_rank1"] = catch(lambda: lightspeed.gather_for_metrics({"x": x}, state=state))
    out["nested_gather_all"] = catch(lambda: lightspeed.gather_for_metrics({"x": nested}, state=state))
    padded_or_nested = nested if rank == 0 else torch.zeros(2, 3)
    out["nested_pad_rank0"] = catch(lambda: lightspeed.pad_across_processes([padded_or_nested], dim=1))

    def untracked_dataloader() -> None:
        loader = DataLoader(MapData(6), batch_size=2, sampler=DistributedSampler(MapData(6), shuffle=False))
        lightspeed.gather_for_metrics(torch.zeros(2), dataloader=loader)

    out["untracked_dataloader"] = catch(untracked_dataloader)

    def wrong_dataloader() -> None:  # the batch comes from `other`, the gather names `tracked`
        data = MapData(12)
        tracked = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, shuffle=False))
        other = iter(DataLoader(data, batch_size=3, sampler=DistributedSampler(data, shuffle=False)))
        for _ in lightspeed.track(tracked):
            _, _, idx = next(other)
            lightspeed.gather_for_metrics(idx, dataloader=tracked)

    out["wrong_dataloader"] = catch(wrong_dataloader)

    def wrong_loader_no_sampler() -> None:  # sharded iterables without __len__: rows must still be the batch
        tracked = DataLoader(lightspeed.shard_iterable(WholeStream(12)), batch_size=2)
        other = iter(DataLoader(lightspeed.shard_iterable(WholeStream(12)), batch_size=3))
        for _ in lightspeed.track(tracked):
            _, _, idx = next(other)
            lightspeed.gather_for_metrics(idx)

    out["wrong_loader_no_sampler"] = catch(wrong_loader_no_sampler)

    # the group still works after every error above
    data = MapData(10)
    loader = DataLoader(data, batch_size=3, sampler=DistributedSampler(data, shuffle=False))
    out["recovered"] = gather_loop(loader)["per_batch"]
    return out


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {"world": world, "good": good_cases(rank, world), "errors": error_cases(rank, world)}
    torch.save(results, out_dir / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("LIGHTSPEED_GATHER_TIMEOUT", "60")
    main()
