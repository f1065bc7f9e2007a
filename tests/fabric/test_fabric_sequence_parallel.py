"""Ulysses sequence parallelism in a Fabric loop (``ZeroFabricStrategy(sequence_parallel_size=2)``, 2 CPU ranks):
the loaders of ``fabric.setup_dataloaders`` yield each rank's slice, and a tiny pretrained Llama built under
``fabric.init_module()`` trains exactly as one plain process on the whole sequences, across a ``fabric.save`` /
``fabric.load`` into a new model, under ZeRO-2 and ZeRO-3; ``export_checkpoint`` of the saved checkpoint holds the
weights of that step; ``exact_metrics`` over the slices equals one process on the whole sequences."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _support import long_context
from _support.launch import REPO_ROOT, run_torchrun
from lightspeed.export import export_checkpoint

SCRIPT = REPO_ROOT / "tests" / "fabric" / "scripts" / "zero_sequence_parallel.py"


@pytest.mark.parametrize(("stage", "tiled_logits"), [(2, 0), (3, 3)])
def test_a_fabric_loop_trains_like_one_process_across_a_save_and_load(
    tmp_path: Path, stage: int, tiled_logits: int
) -> None:
    """ZeRO-3 with the loss over chunks of 3 tokens (``tiled_logits_loss=3``)."""
    long_context.write_pretrained(tmp_path / "pretrained")
    run_torchrun(SCRIPT, 2, [str(tmp_path), str(stage), str(tiled_logits)], timeout=600)
    want = long_context.reference(tmp_path / "pretrained", data_parallel=1, steps=2)
    results = [torch.load(tmp_path / f"result_{rank}.pt") for rank in range(2)]
    for rank, result in enumerate(results):
        long_context.assert_close(result["state"], want, f"zero{stage} rank {rank}")
    assert results[0]["losses"] == results[1]["losses"]
    for result in results:  # the attention of another model in the process was not replaced
        assert result["other"][0] == result["other"][1]
    scores = long_context.token_scores(long_context.load(tmp_path / "pretrained"), rows=long_context.SAMPLES - 1)
    for result in results:
        metrics = {"acc": float(result["metrics"]["acc"])}
        metrics.update({f"n/{name}": float(value) for name, value in result["metrics"]["n"].items()})
        assert metrics == pytest.approx(scores, rel=0, abs=1e-6)
        assert result["by_hand"] == (
            "GatherError: gather_for_metrics: ranks 0, 1: with sequence_parallel_size > 1 each rank's step holds a "
            "slice of every sequence, which gathered as samples would be counted as whole ones. Return per-token "
            "predictions and targets of the slice to GatherForMetrics (or from exact_metrics' step), which put the "
            "slices back together first."
        )
    export_checkpoint(tmp_path / f"ck_{stage}", tmp_path / "export")
    saved = load_file(tmp_path / "export" / "model.safetensors")
    first_step = long_context.reference(tmp_path / "pretrained", data_parallel=1, steps=1)
    long_context.assert_close(saved, first_step, f"zero{stage} export")
