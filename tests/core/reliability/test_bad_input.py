"""Bad input on resume: only incomplete checkpoints with ``ckpt_path="last"`` (fresh start, with a warning naming
them), an explicit incomplete checkpoint (an error) and the checkpoint of another model (one error listing every
mismatched parameter, before any step). Under Fabric: ``fabric.load`` of a truncated shard or of another model's
checkpoint, and ``num_nodes`` disagreeing with torchrun, each one clear error on every rank before any step."""

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


# ------------------------------------------------------------------------------------------------------------ Fabric
@pytest.fixture(scope="module")
def fabric_facts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bad_input_fabric")
    proc = run_elastic("fabric_loop.py", 2, ["bad_input", out], max_restarts=0)
    assert proc.returncode == 0, failure(proc)
    return {"out": out, **{rank: json.loads((out / f"facts_rank{rank}.json").read_text()) for rank in (0, 1)}}


@pytest.mark.parametrize("rank", [0, 1])
def test_fabric_load_of_a_truncated_shard_is_one_error_on_every_rank_before_any_step(
    fabric_facts: dict, rank: int
) -> None:
    truncated = fabric_facts["out"] / "truncated.ckpt"
    facts = fabric_facts[rank]
    assert facts["truncated"].startswith(
        f"IncompleteCheckpointError: Checkpoint {str(truncated)!r} is damaged: "
        "checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt ("
    )
    assert facts["truncated"].endswith(
        "It changed after it was written (a truncated copy, a full disk while copying, or a file replaced). "
        "Resume from an earlier checkpoint."
    )
    assert facts["truncated_step"] == 0


@pytest.mark.parametrize("rank", [0, 1])
def test_fabric_load_of_another_models_checkpoint_is_one_error_listing_every_mismatch(
    fabric_facts: dict, rank: int
) -> None:
    good = fabric_facts["out"] / "good.ckpt"
    assert fabric_facts[rank]["other_model"] == (
        f"CheckpointError: Checkpoint {str(good)!r} is not a checkpoint of this model; 3 parameter(s) do not match:\n"
        "  0.weight: (37, 13) in the checkpoint, (41, 13) in the model\n"
        "  0.bias: (37,) in the checkpoint, (41,) in the model\n"
        "  2.weight: (5, 37) in the checkpoint, (5, 41) in the model\n"
        "Resume from a checkpoint of the same model (or load matching weights only with `model.strict_loading = "
        "False` outside `fit`)."
    )
    assert fabric_facts[rank]["other_model_step"] == 0


def test_fabric_num_nodes_that_disagrees_with_torchrun_is_one_clear_error(fabric_facts: dict) -> None:
    assert fabric_facts[0]["num_nodes"] == (
        "WorldSizeMismatchError: `Fabric(num_nodes=2, devices=2)` asks for 4 processes, but torchrun started 2 "
        "(1 node(s) x 2 per node: WORLD_SIZE=2, LOCAL_WORLD_SIZE=2). Set `Fabric(num_nodes=1, devices=2)`, or start "
        "torchrun with `--nnodes 2 --nproc-per-node 2`."
    )


@pytest.mark.parametrize("rank", [0, 1])
def test_fabric_load_of_the_tag_folder_names_the_checkpoint_to_load(fabric_facts: dict, rank: int) -> None:
    good = fabric_facts["out"] / "good.ckpt"
    assert fabric_facts[rank]["tag_folder"] == (
        f"CheckpointError: {str(good / 'checkpoint')!r} is a folder inside the checkpoint {str(good)!r}, not a "
        f"checkpoint of its own: load the checkpoint directory itself, {str(good)!r}."
    )
