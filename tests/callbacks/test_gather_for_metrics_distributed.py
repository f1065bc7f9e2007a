"""GatherForMetrics in real multi-process Lightning runs: Lightning DDP on 3 CPU ranks and lightspeed's ZeRO-3 on 2.

Each launch (tests/callbacks/scripts/gather_lightning.py) runs fit (with a 1-batch sanity check), validate and
test over five validation dataloaders: map-style that does not divide, shuffled, dividing, an IterableDataset
with __len__ (padded round-robin shards) and one without (unpadded, ragged). The logged metrics must equal the
single-process metrics computed here, exactly; the torchmetrics ``sync_dist`` values logged in the same run must
show the duplicates; and hand-written gathers inside the LightningModule must return exactly the real samples.
Lightning's ``sync_dist=True`` hint must be silenced for the callback's values only, and a step that returns the
wrong keys on one rank must raise the same error on every rank (in every ``gather_every`` mode) instead of hanging.
Whatever the gather window (one batch, two, sized automatically, the whole epoch), the metrics must be updated once
per global batch with that batch's real samples.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torchmetrics
from torch.utils.data import DistributedSampler

from _support.launch import run_python

SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core" / "gather" / "scripts"))
sys.path.insert(0, str(SCRIPTS))
from gather_data import NUM_CLASSES, LengthIterable, MapData, ShardedIterable, reference  # noqa: E402
from gather_lightning import MODES, TEST, VAL  # noqa: E402
from gather_scenarios import SHUFFLE_SEED  # noqa: E402

# (strategy, ranks); LIGHTSPEED_GATHER_TEST_RUNS="zero1:2,zero2_offload:3" runs others (each launch ~20-60 s here)
RUNS = [
    (spec.split(":")[0], int(spec.split(":")[1]))
    for spec in os.environ.get("LIGHTSPEED_GATHER_TEST_RUNS", "ddp:3,zero3:2").split(",")
]


@pytest.fixture(scope="module", params=RUNS, ids=lambda r: f"{r[0]}-{r[1]}ranks")
def run(request, tmp_path_factory):
    strategy, world = request.param
    out = tmp_path_factory.mktemp(f"gather_{strategy}_{world}")
    env = {"DS_ACCELERATOR": "cpu", "LIGHTSPEED_GATHER_TIMEOUT": "120"}
    run_python(SCRIPTS / "gather_lightning.py", [out, world, strategy], env=env)
    return world, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def metrics_on(indices: list[int], n: int) -> dict[str, float]:
    ref = reference(n)
    order = torch.tensor(indices, dtype=torch.long)
    preds, target = ref["preds"][order], ref["target"][order]
    acc = torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")
    f1 = torchmetrics.classification.MulticlassF1Score(NUM_CLASSES, average="macro")
    return {"acc": float(acc(preds, target)), "f1": float(f1(preds, target)), "count": float(len(indices))}


def evaluated(kind: str, n: int, world: int) -> list[int] | None:
    """Every sample the ranks evaluate, duplicates included (None: depends on the shuffle seed and epoch)."""
    if kind == "map":
        total = -(-n // world) * world
        return list(range(n)) + list(range(total - n))  # DistributedSampler pads with the first indices
    if kind == "iterable_len":
        return [int(s[2]) for r in range(world) for s in LengthIterable(n, r, world)]
    return list(range(n))


def update_sizes(n: int, batch_size: int, world: int) -> float:
    """Sum over global batches of (real samples in the batch)^2: what UpdateSizes logs with one update per batch.

    Every layout here gives rank r ``len(range(r, n, world))`` real samples first (a sampler or a padded shard then
    pads them to ``ceil(n / world)``), so step s holds ``min(batch_size, real - s * batch_size)`` real ones on rank r.
    """
    real = [len(range(r, n, world)) for r in range(world)]
    steps = math.ceil(math.ceil(n / world) / batch_size)
    sizes = [sum(min(batch_size, max(0, own - step * batch_size)) for own in real) for step in range(steps)]
    return float(sum(size**2 for size in sizes))


def shard_orders(n: int, batch_size: int, world: int) -> tuple[list[int], list[int]]:
    """Unpadded shards: per-batch gathers come back step by step, rank by rank; one epoch-end gather rank by rank."""
    shards = [[int(s[2]) for s in ShardedIterable(n, r, world, padded=False)] for r in range(world)]
    steps = max(-(-len(s) // batch_size) for s in shards)
    per_batch = [i for step in range(steps) for s in shards for i in s[step * batch_size : (step + 1) * batch_size]]
    return per_batch, [i for s in shards for i in s]


@pytest.mark.parametrize("phase", ["fit", "validate"])
@pytest.mark.parametrize("position", range(len(VAL)), ids=list(VAL))
def test_logged_validation_metrics_equal_single_process(run, phase, position):
    world, ranks = run
    kind, n, _, shuffle = list(VAL.values())[position]
    expected = metrics_on(list(range(n)), n)
    sizes = update_sizes(n, list(VAL.values())[position][2], world)
    for result in ranks:
        logged = result["logged"][phase]
        for name in ("acc", "f1", "count"):
            assert logged[f"val/{name}/dataloader_idx_{position}"].item() == expected[name], name
        for prefix, mode in MODES.items():
            assert logged[f"{prefix}/acc/dataloader_idx_{position}"].item() == expected["acc"], f"gather_every={mode!r}"
            assert logged[f"{prefix}/sizes/dataloader_idx_{position}"].item() == sizes, f"gather_every={mode!r}"
        assert (
            result["results"]["validate"][f"val/acc/dataloader_idx_{position}"].item()
            == logged[f"val/acc/dataloader_idx_{position}"].item()
        )
        # torchmetrics' own sync in the same run counted every evaluated sample, duplicates included
        duplicated = evaluated(kind, n, world)
        assert logged[f"plain/count/dataloader_idx_{position}"].item() == (
            len(duplicated) if not shuffle else -(-n // world) * world
        )
        if not shuffle:
            assert logged[f"plain/acc/dataloader_idx_{position}"].item() == metrics_on(duplicated, n)["acc"]
        has_duplicates = logged[f"plain/count/dataloader_idx_{position}"].item() != n
        assert has_duplicates == (n % world != 0 and kind != "iterable_nolen")


def test_the_runs_contain_duplicates(run):
    world, _ = run
    padded = [name for name, (kind, n, _, _) in VAL.items() if kind != "iterable_nolen" and n % world]
    assert len(padded) >= 3, padded


def test_logged_test_metrics_equal_single_process(run):
    world, ranks = run
    kind, n, _, _ = TEST
    expected = metrics_on(list(range(n)), n)
    duplicated = evaluated(kind, n, world)
    for result in ranks:
        logged = result["logged"]["test"]
        assert {name: logged[f"test/{name}"].item() for name in ("acc", "f1", "count")} == expected
        for prefix in MODES:
            assert logged[f"{prefix.replace('val', 'test')}/acc"].item() == expected["acc"], prefix
            assert logged[f"{prefix.replace('val', 'test')}/sizes"].item() == update_sizes(n, TEST[2], world), prefix
        assert logged["plain/count"].item() == len(duplicated) != n
        assert logged["plain/acc"].item() == metrics_on(duplicated, n)["acc"] != expected["acc"]


@pytest.mark.parametrize("phase", ["fit", "validate", "test"])
def test_hand_written_gathers_in_the_module_return_exactly_the_real_samples(run, phase):
    world, ranks = run
    loaders = [TEST] if phase == "test" else list(VAL.values())
    for result in ranks:
        record = result["record"][phase]
        assert sorted(record) == list(range(len(loaders)))
        for position, (kind, n, batch_size, shuffle) in enumerate(loaders):
            got = record[position]
            if kind == "iterable_nolen":
                per_batch, epoch_end = shard_orders(n, batch_size, world)
            else:
                per_batch = epoch_end = list(range(n))
            if shuffle:  # the sampler's order, which changes with the epoch: compare as sets of exactly-once samples
                assert sorted(got["per_batch_idx"].tolist()) == per_batch
                assert got["epoch_end_idx"].tolist() == got["per_batch_idx"].tolist()
            else:
                assert got["per_batch_idx"].tolist() == per_batch
                assert got["epoch_end_idx"].tolist() == epoch_end
            assert got["per_batch_names"] == [f"s{i}" for i in got["per_batch_idx"].tolist()]


def test_sync_dist_hint_is_silenced_for_the_callbacks_values_only(run):
    _, ranks = run
    hints = ranks[0]["sync_dist_hints"]  # Lightning warns on rank 0 only
    assert any("self.log('val/own'" in hint for hint in hints), hints
    ours = ("'val/acc", "'val/f1", "'val/count", "'val/sizes", "'val_", "'test/", "'test_")
    assert not [hint for hint in hints if any(name in hint for name in ours)]


@pytest.mark.parametrize("mode", list(dict.fromkeys(MODES.values())))
def test_wrong_step_output_on_one_rank_raises_the_same_error_on_every_rank(run, mode):
    _, ranks = run
    expected = (
        "StepOutputError: gather_for_metrics: rank 1: GatherForMetrics reads 'logits_argmax' and 'labels' from what "
        "validation_step returns, but it returned a dict with keys ['labels', 'logits'] (missing ['logits_argmax']). "
        "Return {'logits_argmax': ..., 'labels': ...} from validation_step, or pass "
        "GatherForMetrics(..., preds_key=..., target_key=...)."
    )
    assert [result["wrong_keys"][mode] for result in ranks] == [expected] * len(ranks)


def test_outputs_ragged_across_ranks_name_the_window_and_the_fix_on_every_rank(run):
    """Rank 1's predictions are wider, so it sizes its windows smaller and gathers at another batch than the others."""
    _, ranks = run
    for rank, result in enumerate(ranks):
        message = result["ragged"]
        assert message is not None and message.startswith(
            "CallSiteMismatchError: gather_for_metrics: the ranks are not in the same call"
        ), message
        window = 1 if rank == 1 else 2
        assert (
            "GatherForMetrics gathers its outputs after the same batches on every rank "
            f"(here a window of {window} batches)" in message
        )
        assert message.endswith(
            "pad them in the step with lightspeed.pad_across_processes(tensor, dim=1, pad_index=...)."
        )


def test_validation_over_a_batch_sampler_holding_a_distributed_sampler_logs_the_single_process_metric(run):
    """Issue #12: DataLoader(batch_size=None, sampler=BatchSampler(DistributedSampler(shuffle=True), 4)), 22 samples."""
    world, ranks = run
    expected = metrics_on(list(range(22)), 22)
    perm = list(DistributedSampler(MapData(22), num_replicas=1, rank=0, shuffle=True, seed=SHUFFLE_SEED))
    checksum = float(sum((p + 1) * i for p, i in enumerate(perm)))
    assert checksum != float(sum((p + 1) * i for p, i in enumerate(sorted(perm))))  # the order is really checked
    for result in ranks:
        logged = result["issue12"]["nested_sampler"]
        assert logged["val/acc"].item() == expected["acc"]
        assert logged["val/count"].item() == 22.0  # not 24 (3 ranks pad to 24), not rank-by-rank
        assert logged["order/checksum"].item() == checksum  # the sampler's global order


def test_validation_over_an_unsharded_stream_raises_on_every_rank(run):
    world, ranks = run
    expected = (
        f"GatherError: gather_for_metrics: validate dataloader 0 is not sharded across ranks: all {world} ranks got "
        f"the same first batch, so every rank iterates the whole dataset and the gathered result would hold each "
        f"sample {world} times. An IterableDataset must yield a different shard on each rank: wrap it with "
        "lightspeed.shard_iterable(dataset) (round-robin over ranks and DataLoader workers; give it a __len__ or "
        "length= with the total so the padding is dropped exactly), or split it by rank yourself (e.g. "
        "datasets.distributed.split_dataset_by_node)."
    )
    assert [result["issue12"]["unsharded"] for result in ranks] == [expected] * world
