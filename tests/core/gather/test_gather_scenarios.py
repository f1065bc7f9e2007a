"""Issue #12: gather_for_metrics against a peer library's (HF Accelerate's) own scenarios, on 2 and 3 gloo ranks.

One torchrun launch per world size runs tests/core/gather/scripts/gather_scenarios.py: a DistributedSampler nested in a
BatchSampler given as ``sampler=`` and in a custom batch sampler, ``lightspeed.shard_iterable`` (also with
DataLoader workers), a plain ``for batch in lightspeed.track(loader)`` loop whose metric must equal the
single-process metric, and bad inputs that must raise one clear error on every rank: a stream every rank iterates
whole, nested tensors, a dataloader that is not the one the batch came from. References are computed here,
independently of lightspeed (the sampler's permutation from torch, the metric on the whole dataset).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torchmetrics
from torch.utils.data import DistributedSampler

from _support.launch import run_torchrun

SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from gather_data import NUM_CLASSES, MapData, reference  # noqa: E402
from gather_scenarios import SHUFFLE_SEED  # noqa: E402


@pytest.fixture(scope="module", params=(2, 3), ids=lambda w: f"world{w}")
def run(request):
    world = request.param
    out = Path(tempfile.mkdtemp(prefix=f"lightspeed_scenarios_w{world}_"))
    try:
        run_torchrun(SCRIPTS / "gather_scenarios.py", world, [out], env={"LIGHTSPEED_GATHER_TIMEOUT": "120"})
        yield world, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def sampler_order(n: int, world: int, batch_size: int, drop_last: bool) -> list[int]:
    """The real samples a BatchSampler(DistributedSampler(shuffle=True)) evaluates, in the sampler's global order."""
    perm = list(DistributedSampler(MapData(n), num_replicas=1, rank=0, shuffle=True, seed=SHUFFLE_SEED))
    per_rank = -(-n // world)
    kept = per_rank - per_rank % batch_size if drop_last else per_rank  # positions each rank evaluates
    return [perm[p] for p in range(world * kept) if p < n]


@pytest.mark.parametrize("drop_last", [False, True])
def test_distributed_sampler_inside_a_batch_sampler_given_as_sampler(run, drop_last):
    world, ranks = run
    expected = sampler_order(22, world, 4, drop_last)
    assert len(expected) == (22 if not drop_last or world == 3 else 16)
    for result in ranks:
        got = result["good"][f"nested_sampler_drop{int(drop_last)}"]
        assert got["per_batch"] == expected
        assert got["epoch"] == expected
        assert result["good"]["warnings"] == []  # the sampler is found: no "no DistributedSampler" warning


def test_the_shuffled_order_is_not_rank_by_rank(run):
    """Guards the test above: the sampler's order differs from the rank-by-rank order a missed sampler gave."""
    world, _ = run
    expected = sampler_order(22, world, 4, False)
    per_rank = -(-22 // world)
    indices = expected + expected[: per_rank * world - 22]
    rank_by_rank = [indices[p] for r in range(world) for p in range(r, per_rank * world, world)]
    assert rank_by_rank != expected


def test_distributed_sampler_inside_a_custom_batch_sampler(run):
    _, ranks = run
    for result in ranks:
        assert result["good"]["custom_batch_sampler"] == {"per_batch": list(range(22)), "epoch": list(range(22))}


@pytest.mark.parametrize(
    "case, n", [("shard_iterable", 23), ("shard_iterable_workers", 23), ("shard_iterable_length", 11)]
)
def test_shard_iterable_gives_every_sample_once_in_dataset_order(run, case, n):
    _, ranks = run
    for result in ranks:
        assert result["good"][case] == {"per_batch": list(range(n)), "epoch": list(range(n))}


def test_a_sharded_stream_of_constant_data_is_not_taken_for_a_replicated_one(run):
    _, ranks = run
    assert [result["good"]["constant"] for result in ranks] == [7] * len(ranks)


def test_plain_loop_metric_equals_the_single_process_metric(run):
    _, ranks = run
    ref = reference(7)
    expected = torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")(ref["preds"], ref["target"])
    for result in ranks:
        assert torch.equal(result["good"]["plain_loop_acc"], expected)
        assert torch.equal(result["good"]["plain_loop_acc_dataloader_arg"], expected)


def _unsharded(world: int) -> str:
    return (
        f"GatherError: gather_for_metrics: dataloader 0 is not sharded across ranks: all {world} ranks got the same "
        f"first batch, so every rank iterates the whole dataset and the gathered result would hold each sample "
        f"{world} times. An IterableDataset must yield a different shard on each rank: wrap it with "
        "lightspeed.shard_iterable(dataset) (round-robin over ranks and DataLoader workers; give it a __len__ or "
        "length= with the total so the padding is dropped exactly), or split it by rank yourself (e.g. "
        "datasets.distributed.split_dataset_by_node)."
    )


_NESTED_GATHER = (
    "gather_for_metrics got a nested tensor at data['x']; nested tensors have no regular shape to gather: convert "
    "it with .to_padded_tensor(pad_value) (then lightspeed.pad_across_processes(..., dim=1) if the lengths differ "
    "across ranks), or pass per-sample Python lists: [t.tolist() for t in x.unbind()]."
)
_WRONG_ROWS = (
    "data has 3 samples on dim 0, but the current batch of dataloader 0 has 2 and this rank has produced 2 in total; "
    "gather_for_metrics drops padding along dim 0, so dim 0 must be the batch (a per-batch gather) or everything "
    "gathered so far this epoch (one gather at the end). Move the sample dimension first, and gather data of the "
    "batch that the tracked dataloader yielded (pass dataloader= when several are iterated)."
)


def expected_errors(world: int) -> dict[str, str]:
    everyone = ", ".join(map(str, range(world)))
    return {
        "unsharded_b4": _unsharded(world),
        "unsharded_b30": _unsharded(world),
        "unsharded_nolen": _unsharded(world),
        "unsharded_end_only": _unsharded(world),
        "map_replicated": (
            f"GatherError: gather_for_metrics: dataloader 0 is not sharded across ranks: all {world} ranks got the "
            f"same first batch, so every rank iterates the whole dataset and the gathered result would hold each "
            f"sample {world} times. Give the DataLoader a DistributedSampler (sampler=DistributedSampler(dataset)), "
            "or let Lightning inject one (use_distributed_sampler=True)."
        ),
        "nested_gather_rank1": f"GatherError: gather_for_metrics: rank 1: {_NESTED_GATHER}",
        "nested_gather_all": f"GatherError: gather_for_metrics: ranks {everyone}: {_NESTED_GATHER}",
        "nested_pad_rank0": (
            "GatherError: pad_across_processes: rank 0: pad_across_processes got a nested tensor at data[0]; nested "
            "tensors have no regular shape to gather: convert it first with .to_padded_tensor(pad_value) (it pads "
            "within this rank), then pad the result across ranks with pad_across_processes."
        ),
        "untracked_dataloader": (
            f"GatherError: gather_for_metrics: ranks {everyone}: gather_for_metrics(dataloader=...) got a DataLoader "
            "that is not being iterated with lightspeed.track; loop over it as "
            "`for batch in lightspeed.track(loader):`."
        ),
        "wrong_dataloader": f"GatherError: gather_for_metrics: ranks {everyone}: {_WRONG_ROWS}",
        "wrong_loader_no_sampler": f"GatherError: gather_for_metrics: ranks {everyone}: {_WRONG_ROWS}",
    }


@pytest.mark.parametrize("case", list(expected_errors(2)))
def test_bad_input_raises_one_clear_error_on_every_rank(run, case):
    world, ranks = run
    assert [result["errors"][case] for result in ranks] == [expected_errors(world)[case]] * world


def test_the_group_still_works_after_the_errors(run):
    _, ranks = run
    assert all(result["errors"]["recovered"] == list(range(10)) for result in ranks)
