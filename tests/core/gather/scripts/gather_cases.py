"""Worker for tests/core/gather/test_gather_distributed.py: evaluate many dataset layouts with plain PyTorch + gloo.

Run with torchrun; argv[1] is the output directory. Every rank saves ``rank{r}.pt`` holding, per case, what
gather_for_metrics returned (per-batch and epoch-end), the metric values computed on it, and torchmetrics' own
``sync_dist`` value computed on the ungathered local data (which still contains the sampler's duplicates).
With 3 ranks it then runs the bad-input cases of gather_errors.py.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torchmetrics
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gather_data import NUM_CLASSES, LengthIterable, MapData, ShardedIterable, model  # noqa: E402

from lightspeed import gather_for_metrics, gather_object, pad_across_processes  # noqa: E402
from lightspeed.core.gather import GatherState, current_state, track  # noqa: E402
from lightspeed.core.gather.accounting import set_current_state  # noqa: E402
from lightspeed.core.gather.window import BatchWindow  # noqa: E402

# name -> (kind, n, batch_size, options)
CASES = {
    "map_divides": ("map", 12, 2, {}),
    "map_ragged": ("map", 10, 2, {}),
    "map_ragged_b3": ("map", 11, 3, {}),
    "map_tiny": ("map", 2, 2, {}),
    "map_shuffle": ("map", 17, 4, {"shuffle": True}),
    "map_sampler_drop_last": ("map", 11, 2, {"sampler_drop_last": True}),
    "map_loader_drop_last": ("map", 13, 3, {"loader_drop_last": True}),
    "iterable_len": ("iterable_len", 11, 2, {}),
    "iterable_len_b3": ("iterable_len", 13, 3, {}),
    "iterable_nolen": ("iterable_nolen", 10, 2, {}),
    "iterable_nolen_b4": ("iterable_nolen", 11, 4, {}),
}


def make_loader(kind: str, n: int, batch_size: int, rank: int, world: int, options: dict) -> DataLoader:
    if kind == "map":
        dataset = MapData(n)
        sampler = DistributedSampler(
            dataset,
            num_replicas=world,
            rank=rank,
            shuffle=options.get("shuffle", False),
            seed=7,
            drop_last=options.get("sampler_drop_last", False),
        )
        return DataLoader(
            dataset, batch_size=batch_size, sampler=sampler, drop_last=options.get("loader_drop_last", False)
        )
    if kind == "iterable_len":
        return DataLoader(LengthIterable(n, rank, world), batch_size=batch_size)
    return DataLoader(ShardedIterable(n, rank, world, padded=False), batch_size=batch_size)


def run_case(kind: str, n: int, batch_size: int, options: dict, rank: int, world: int) -> dict:
    net = model()
    loader = make_loader(kind, n, batch_size, rank, world, options)
    state = GatherState.from_dataloader(loader, name=f"case {kind}")
    acc = torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro", sync_on_compute=False)
    total = torchmetrics.SumMetric(sync_on_compute=False)
    plain_acc = torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")  # syncs with duplicates
    plain_total = torchmetrics.SumMetric()
    batch_parts: dict[str, list] = {"preds": [], "target": [], "idx": [], "idx_again": [], "names": []}
    local_preds, local_idx, scalar_rows, masked_correct = [], [], [], []
    window, windowed = None, []  # two consecutive batches per gather, split back per batch
    for x, y, idx in track(loader, state):
        assert current_state() is state
        with torch.no_grad():
            preds = net(x).argmax(-1)
        out = gather_for_metrics({"preds": preds, "target": y, "idx": idx})
        again = gather_for_metrics(idx)  # a second gather in the same batch sees the same positions
        names = gather_for_metrics([f"s{int(i)}" for i in idx])  # per-sample Python objects
        for key in ("preds", "target", "idx"):
            batch_parts[key].append(out[key])
        batch_parts["idx_again"].append(again)
        batch_parts["names"].extend(names)
        acc.update(out["preds"], out["target"])
        total.update((out["idx"] + 1).double())
        plain_acc.update(preds, y)
        plain_total.update((idx + 1).double())
        # scalars: a 0-d tensor is one value per rank; masking padding before reducing makes the sum exact
        scalar_rows.append(gather_for_metrics(torch.tensor(float(len(idx)))))
        mask = state.real_mask()
        masked_correct.append(gather_for_metrics((preds[mask] == y[mask]).sum()))
        local_preds.append(preds)
        local_idx.append(idx)
        window = window or BatchWindow(first_sample=state.batch_start)
        window.add({"idx": idx, "names": [f"s{int(i)}" for i in idx]})
        if window.batches == 2:
            windowed += window.gather(state)
            window = None
    if window is not None:
        windowed += window.gather(state)
    assert current_state() is state  # stays current after the loop, for one gather of everything
    epoch = gather_for_metrics({"preds": torch.cat(local_preds), "idx": torch.cat(local_idx)})
    return {
        "per_batch": {k: (torch.cat(v) if k != "names" else v) for k, v in batch_parts.items()},
        "per_batch_idx_lists": [t.tolist() for t in batch_parts["idx"]],
        "windowed": [(b["idx"].tolist(), b["names"]) for b in windowed],
        "epoch_end": epoch,
        "acc": acc.compute(),
        "sum": total.compute(),
        "plain_sync_acc": plain_acc.compute(),
        "plain_sync_sum": plain_total.compute(),
        "scalar_rows": torch.stack(scalar_rows),
        "masked_correct": torch.stack(masked_correct).sum(),
        "real_total": state.real_total,
        "local_seen": state.seen,
        "layout": state.layout,
    }


def extras(rank: int, world: int) -> dict:
    """Padding, object gather, the no-state fallback, nested structures."""
    out: dict = {}
    # ragged sequence lengths on dim 1: rank r has length r + 2
    seq = torch.full((2, rank + 2), rank + 1, dtype=torch.int64)
    out["pad_right"] = pad_across_processes(seq, dim=1, pad_index=-1)
    out["pad_left"] = pad_across_processes(seq, dim=1, pad_index=-1, pad_first=True)
    nested = {"a": torch.ones(rank + 1, 3), "b": [torch.zeros(2, rank + 1, dtype=torch.bool), "keep"]}
    out["pad_nested"] = pad_across_processes(nested, dim=0)
    # after padding dim 1, the ragged tensors can be gathered (no state: every row kept)
    state = GatherState.shards(world_size=world, rank=rank)
    state.begin_batch(2)
    out["padded_then_gathered"] = gather_for_metrics(out["pad_right"], state=state)
    out["gather_object"] = gather_object({"rank": rank, "text": "x" * rank})
    # a nested structure with a tuple, a per-rank object and a namedtuple-free list container
    state = GatherState.shards(world_size=world, rank=rank)
    state.begin_batch(rank + 1)
    out["nested"] = gather_for_metrics(
        {
            "t": (torch.full((rank + 1,), rank), torch.arange(rank + 1).float()),
            "who": f"rank{rank}",
            "flag": torch.tensor(rank > 0),
        },
        state=state,
    )
    # more leaves than the header carries inline, and more data than rides in the header's collective
    state = GatherState.shards(world_size=world, rank=rank)
    state.begin_batch(2)
    out["many_leaves"] = gather_for_metrics(
        {f"k{i}": torch.full((2, 1), 100 * rank + i) for i in range(30)}, state=state
    )
    state = GatherState.shards(world_size=world, rank=rank)
    state.begin_batch(rank + 1)
    out["large"] = gather_for_metrics(torch.full((rank + 1, 70_000), float(rank)), state=state)
    # integers narrowed for the wire, each rank to another width: the values and dtypes come back exactly
    state = GatherState.shards(world_size=world, rank=rank)
    state.begin_batch(2)
    wide = [torch.tensor([0, 200]), torch.tensor([-5, 100]), torch.tensor([2**40, -(2**33)])][rank % 3]
    out["wire"] = gather_for_metrics(
        {"int64": wide, "int32": wide.clamp(-(2**31), 2**31 - 1).to(torch.int32)}, state=state
    )
    # no state at all: falls back to a plain gather and warns once
    set_current_state(None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = gather_for_metrics(torch.tensor([rank, rank]))
        second = gather_for_metrics(torch.tensor([rank]))
    out["fallback"] = (first, second)
    out["fallback_warnings"] = [str(w.message) for w in caught if "no evaluation state" in str(w.message)]
    return out


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results = {"world": world, "cases": {}}
    for name, (kind, n, batch_size, options) in CASES.items():
        results["cases"][name] = run_case(kind, n, batch_size, options, rank, world)
    results["extras"] = extras(rank, world)
    torch.save(results, out_dir / f"rank{rank}.pt")
    dist.barrier()
    if world == 3:  # the bad-input cases ride along on the 3-rank launch (they end the process)
        from gather_errors import run_errors

        run_errors(out_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("LIGHTSPEED_GATHER_TIMEOUT", "60")
    main()
