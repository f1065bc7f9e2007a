"""gather_for_metrics / pad_across_processes / gather_object on 2 and 3 real gloo ranks (plain PyTorch, torchrun).

One torchrun launch per world size runs every case in tests/core/gather/scripts/gather_cases.py; each assertion below
compares what the ranks gathered with a single-process reference computed here. The reference's set of real
samples is derived independently of lightspeed: every rank's DataLoader is replayed in this process and the
duplicates are found by sample index (the data has unique indices, padding repeats them).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torchmetrics
from torch.utils.data import DistributedSampler

SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from gather_cases import CASES, make_loader  # noqa: E402
from gather_data import NUM_CLASSES, MapData, reference  # noqa: E402
from gather_launch import case_results  # noqa: E402

WORLD_SIZES = (2, 3)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def run(request):
    return request.param, case_results(request.param)


def replay(name: str, world: int) -> list[list[list[int]]]:
    """Per rank, per batch: the dataset indices that rank evaluates (duplicates included)."""
    kind, n, batch_size, options = CASES[name]
    return [[b[2].tolist() for b in make_loader(kind, n, batch_size, r, world, options)] for r in range(world)]


def expected(name: str, world: int) -> dict:
    kind, n, batch_size, options = CASES[name]
    batches = replay(name, world)
    evaluated = [i for rank in batches for batch in rank for i in batch]
    real = sorted(set(evaluated))
    if options.get("shuffle"):
        perm = list(DistributedSampler(MapData(n), num_replicas=1, rank=0, shuffle=True, seed=7))
        per_batch = epoch = [i for i in perm if i in set(real)]
    elif kind == "iterable_nolen":  # shards: rank by rank (per batch step, then per rank)
        steps = max(len(b) for b in batches)
        per_batch = [
            i for s in range(steps) for r in range(world) for i in (batches[r][s] if s < len(batches[r]) else [])
        ]
        epoch = [i for r in range(world) for batch in batches[r] for i in batch]
    else:  # strided layouts come back in dataset order
        per_batch = epoch = real
    return {"real": real, "evaluated": evaluated, "per_batch": per_batch, "epoch": epoch, "batches": batches}


def accuracy(preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    metric = torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")
    metric.update(preds, target)
    return metric.compute()


@pytest.mark.parametrize("name", list(CASES))
def test_gathered_samples_are_exactly_the_real_ones_in_dataset_order(run, name):
    world, ranks = run
    exp = expected(name, world)
    ref = reference(CASES[name][1])
    for rank, result in enumerate(ranks):
        case = result["cases"][name]
        per_batch = case["per_batch"]
        assert per_batch["idx"].tolist() == exp["per_batch"], f"rank {rank}"
        assert per_batch["idx_again"].tolist() == exp["per_batch"], "second gather in the same batch"
        assert per_batch["names"] == [f"s{i}" for i in exp["per_batch"]], "per-sample objects"
        order = torch.tensor(exp["per_batch"], dtype=torch.long)
        assert torch.equal(per_batch["preds"], ref["preds"][order])
        assert torch.equal(per_batch["target"], ref["target"][order])
        epoch_order = torch.tensor(exp["epoch"], dtype=torch.long)
        assert case["epoch_end"]["idx"].tolist() == exp["epoch"], "one gather at epoch end"
        assert torch.equal(case["epoch_end"]["preds"], ref["preds"][epoch_order])
        assert case["real_total"] == len(exp["real"])


@pytest.mark.parametrize("name", list(CASES))
def test_windows_of_two_batches_split_back_into_the_per_batch_gathers(run, name):
    """One gather of two consecutive batches (first_sample=...) returns, batch by batch, what per-batch gathers do."""
    world, ranks = run
    for result in ranks:
        case = result["cases"][name]
        per_batch = [batch for batch in case["per_batch_idx_lists"] if batch]  # a batch of only padding has no rows
        assert [idx for idx, _ in case["windowed"]] == per_batch
        assert [names for _, names in case["windowed"]] == [[f"s{i}" for i in batch] for batch in per_batch]


@pytest.mark.parametrize("name", list(CASES))
def test_metric_equals_single_process_metric_and_plain_sync_counts_duplicates(run, name):
    world, ranks = run
    exp = expected(name, world)
    ref = reference(CASES[name][1])
    real = torch.tensor(exp["real"], dtype=torch.long)
    evaluated = torch.tensor(exp["evaluated"], dtype=torch.long)
    ref_acc = accuracy(ref["preds"][real], ref["target"][real])
    dup_acc = accuracy(ref["preds"][evaluated], ref["target"][evaluated])
    for result in ranks:
        case = result["cases"][name]
        assert torch.equal(case["acc"], ref_acc)
        assert case["sum"].item() == float((real + 1).sum())
        # torchmetrics' own sync over the ungathered data sees every evaluated sample, duplicates included
        assert torch.equal(case["plain_sync_acc"], dup_acc)
        assert case["plain_sync_sum"].item() == float((evaluated + 1).sum())
        has_duplicates = len(exp["evaluated"]) > len(exp["real"])
        assert (case["plain_sync_sum"].item() != case["sum"].item()) == has_duplicates


def test_some_cases_really_have_duplicates(run):
    """Guards the suite itself: without padded cases the comparison above would prove nothing."""
    world, _ = run
    padded = [name for name in CASES if len(expected(name, world)["evaluated"]) > len(expected(name, world)["real"])]
    assert {"map_ragged_b3", "map_shuffle", "iterable_len", "iterable_len_b3"} <= set(padded)


@pytest.mark.parametrize("name", ["map_ragged", "map_shuffle", "iterable_len", "iterable_nolen"])
def test_scalars_are_one_value_per_rank_and_masking_makes_them_exact(run, name):
    world, ranks = run
    exp = expected(name, world)
    ref = reference(CASES[name][1])
    real = torch.tensor(exp["real"], dtype=torch.long)
    steps = max(len(b) for b in exp["batches"])
    rows = [[float(len(exp["batches"][r][s])) for r in range(world)] for s in range(steps)]
    for result in ranks:
        case = result["cases"][name]
        # a 0-d tensor per rank comes back as shape [world_size], nothing dropped even at the padded last batch
        assert case["scalar_rows"].tolist() == rows
        assert case["masked_correct"].item() == int((ref["preds"][real] == ref["target"][real]).sum())


def test_all_ranks_return_identical_results(run):
    world, ranks = run
    for name in CASES:
        first = ranks[0]["cases"][name]
        for other in ranks[1:]:
            assert torch.equal(first["per_batch"]["idx"], other["cases"][name]["per_batch"]["idx"])
            assert torch.equal(first["acc"], other["cases"][name]["acc"])


def test_pad_across_processes_pads_to_the_longest_rank(run):
    world, ranks = run
    longest = world + 1  # rank r has length r + 2
    for rank, result in enumerate(ranks):
        extras = result["extras"]
        valid = [rank + 1] * (rank + 2)
        assert extras["pad_right"].tolist() == [valid + [-1] * (longest - rank - 2)] * 2
        assert extras["pad_left"].tolist() == [[-1] * (longest - rank - 2) + valid] * 2
        assert extras["pad_nested"]["a"].shape == (world, 3)
        assert extras["pad_nested"]["a"][: rank + 1].eq(1).all() and extras["pad_nested"]["a"][rank + 1 :].eq(0).all()
        assert extras["pad_nested"]["b"][0].shape == (2, rank + 1) and extras["pad_nested"]["b"][1] == "keep"
        gathered = extras["padded_then_gathered"]
        assert gathered.shape == (2 * world, longest)
        assert gathered[:, 0].tolist() == [r + 1 for r in range(world) for _ in range(2)]


def test_gather_object_and_nested_structures(run):
    world, ranks = run
    for result in ranks:
        extras = result["extras"]
        assert extras["gather_object"] == [{"rank": r, "text": "x" * r} for r in range(world)]
        nested = extras["nested"]
        assert isinstance(nested, dict) and isinstance(nested["t"], tuple)
        assert nested["t"][0].tolist() == [r for r in range(world) for _ in range(r + 1)]
        assert nested["t"][1].tolist() == [float(i) for r in range(world) for i in range(r + 1)]
        assert nested["who"] == [f"rank{r}" for r in range(world)]
        assert nested["flag"].dtype == torch.bool and nested["flag"].tolist() == [r > 0 for r in range(world)]


def test_without_state_falls_back_to_plain_gather_and_warns_once(run):
    world, ranks = run
    for result in ranks:
        first, second = result["extras"]["fallback"]
        assert first.tolist() == [r for r in range(world) for _ in range(2)]
        assert second.tolist() == list(range(world))
        assert len(result["extras"]["fallback_warnings"]) == 1
        assert "GatherForMetrics callback" in result["extras"]["fallback_warnings"][0]


def test_many_leaves_and_large_tensors_take_the_extra_collectives(run):
    world, ranks = run
    for result in ranks:
        many = result["extras"]["many_leaves"]
        assert sorted(many) == sorted(f"k{i}" for i in range(30))
        assert all(
            many[f"k{i}"].flatten().tolist() == [100 * r + i for r in range(world) for _ in range(2)] for i in range(30)
        )
        large = result["extras"]["large"]
        assert large.shape == (world * (world + 1) // 2, 70_000)
        assert large[:, 0].tolist() == [float(r) for r in range(world) for _ in range(r + 1)]
        assert bool((large == large[:, :1]).all())


def test_integers_narrowed_for_the_wire_come_back_exactly(run):
    world, ranks = run
    per_rank = [[0, 200], [-5, 100], [2**40, -(2**33)]]
    expected = [v for r in range(world) for v in per_rank[r % 3]]
    for result in ranks:
        wire = result["extras"]["wire"]
        assert wire["int64"].dtype == torch.int64 and wire["int64"].tolist() == expected
        assert wire["int32"].dtype == torch.int32
        assert wire["int32"].tolist() == [max(-(2**31), min(2**31 - 1, v)) for v in expected]
