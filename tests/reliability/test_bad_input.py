"""Bad input on resume: only incomplete checkpoints with ``ckpt_path="last"`` (fresh start, with a warning naming
them), an explicit incomplete checkpoint (an error) and the checkpoint of another model (one error listing every
mismatched parameter, before any step)."""

from __future__ import annotations

import json

import pytest
from _elastic import failure, run_elastic


@pytest.fixture(scope="module")
def facts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bad_input")
    proc = run_elastic("bad_input.py", 2, [out], max_restarts=0)
    assert proc.returncode == 0, failure(proc)
    return {"out": out, **json.loads((out / "facts.json").read_text())}


def test_last_with_only_an_interrupted_save_starts_fresh_and_names_it(facts: dict) -> None:
    staging = facts["out"] / "ckpts" / "last.ckpt.lightspeed-staging"
    assert facts["fresh_first_step"] == 0
    assert facts["warnings"] == [
        f"lightspeed: training starts fresh; skipped 1 incomplete checkpoint(s): {str(staging)!r} (an interrupted "
        "save; removed at the next save)."
    ]
    assert facts["after_first_save"] == ["epoch=0-step=2.ckpt", "last.ckpt"]  # swept by the first save


def test_an_explicit_incomplete_checkpoint_is_an_error(facts: dict) -> None:
    staging = facts["out"] / "ckpts" / "last.ckpt.lightspeed-staging"
    assert facts["explicit_incomplete"] == (
        f"IncompleteCheckpointError: Checkpoint {str(staging)!r} has no 'lightspeed_complete.json': it was not "
        "written completely (the save was interrupted, or it was not written by lightspeed). Resume from an earlier "
        "checkpoint instead."
    )


def test_the_checkpoint_of_another_model_is_one_error_listing_every_mismatch_before_any_step(facts: dict) -> None:
    last = facts["out"] / "ckpts" / "last.ckpt"
    assert facts["other_model"] == (
        f"CheckpointError: Checkpoint {str(last)!r} is not a checkpoint of this model; 3 parameter(s) do not match:\n"
        "  net.0.weight: (37, 13) in the checkpoint, (41, 13) in the model\n"
        "  net.0.bias: (37,) in the checkpoint, (41,) in the model\n"
        "  net.2.weight: (5, 37) in the checkpoint, (5, 41) in the model\n"
        "Resume from a checkpoint of the same model (or load matching weights only with `model.strict_loading = "
        "False` outside `fit`)."
    )
    assert facts["other_model_batches"] == 0
