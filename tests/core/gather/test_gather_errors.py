"""Bad input to the gathers on 3 real gloo ranks: each mistake raises a clear error on every rank, naming the rank.

The cases (tests/core/gather/scripts/gather_errors.py) run at the end of the 3-rank launch of gather_cases.py, shared
with test_gather_distributed.py; the process group keeps working
after each error (checked by a correct gather at the end), and a gather that one rank never joins fails after
LIGHTSPEED_GATHER_TIMEOUT seconds on every rank that came, naming the one that did not, instead of hanging.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from gather_launch import error_results  # noqa: E402


@pytest.fixture(scope="module")
def errors():
    return error_results()


# case -> pattern every rank's message must match
EVERY_RANK = {
    "dtype": r"GatherError: gather_for_metrics: rank 1 passed different data than rank 0 \(rank 0 has "
    r"\"data\['preds'\]: tensor float32 with 1 dims\", rank 1 has \"data\['preds'\]: tensor float16",
    "structure": r"rank 2 passed different data than rank 0 \(rank 0 has 2 leaves, rank 2 has 1; "
    r"unmatched: \"data\['target'\]",
    "trailing_dims": r"data has shape \[n, 5\] on rank 1 but \[n, 4\] on rank 0; only dim 0 may differ\. "
    r"Pad it first: lightspeed\.pad_across_processes\(tensor, dim=1",
    "not_batch_dim": r"rank 0: data has 6 samples on dim 0, but the current batch of dataloader 0 has 3 .* "
    r"Move the sample dimension first",
    "first_sample_out_of_range": r"rank 1: data has 3 samples starting at first_sample=2, but this rank has produced 3 "
    r"samples of dataloader 0 so far; first_sample must be >= 0",
    "pad_ndim": r"pad_across_processes: rank 2 passed different data than rank 0 .*3 dims.*2 dims",
    "pad_dim_out_of_range": r"pad_across_processes: rank 0: dim=2 is out of range for data with shape \[2, 2\]",
    "uneven_batches": r"^CallSiteMismatchError: gather_for_metrics: the ranks are not in the same call \(rank 0 is in "
    r"gather_for_metrics in batch 2 of dataloader 0; rank 1 is "
    r"in the end of dataloader 0 after 1 batches; rank 2 is in the end of dataloader 0 after 1 batches\)",
    "uneven_pad": r"CallSiteMismatchError: (pad_across_processes|gather_for_metrics): the ranks are not in the same "
    r"call \(rank 0 is in pad_across_processes; "
    r"rank 1 is in the end of dataloader 0 after 1 batches; rank 2 is in the end of dataloader 0",
    "fail_gather": r"^NoPredictions: gather_for_metrics: rank 2: validation_step returned None; "
    r"return the predictions\.$",
    "fail_gather_everywhere": r"^NoPredictions: gather_for_metrics: ranks 0, 1, 2: no predictions\.$",
    "per_rank_len": r"in batch 2 of dataloader 0 every sample on every rank counts as padding "
    r"\(len\(dataset\) = 4 over 3 ranks\).*return the total instead",
    "differing_len": r"rank 1 counts its evaluation samples differently than rank 0 \(rank 0 has 'accounting: strided, "
    r"total=12.*rank 1 has 'accounting: strided, total=13",
}


@pytest.mark.parametrize("case", list(EVERY_RANK))
def test_mismatch_raises_on_every_rank_naming_the_rank(errors, case):
    for rank, result in enumerate(errors):
        assert result[case] is not None, f"rank {rank} raised nothing for {case}"
        assert re.search(EVERY_RANK[case], result[case]), f"rank {rank}: {result[case]}"


def test_group_still_works_after_the_errors(errors):
    assert all(result["recovered"] is None for result in errors)


def test_gather_that_a_rank_never_joins_names_that_rank_on_every_rank_that_came(errors):
    expected = (
        "GatherError: gather_for_metrics: rank(s) 1 did not arrive within 3 s; every rank must call it the same "
        "number of times (e.g. all ranks run the same number of evaluation batches); raise LIGHTSPEED_GATHER_TIMEOUT "
        "(now 3 s) if a rank is merely slow."
    )
    assert errors[0]["missing_rank"] == expected
    assert errors[2]["missing_rank"] == expected
    assert errors[1]["missing_rank"] is None  # the rank that stayed away
