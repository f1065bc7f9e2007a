"""Model shapes users build every day under the Trainer's ZeRO strategies, against one plain process (fp32, 2 CPU
ranks, <= 1e-5): an ``nn.TransformerEncoder`` built in ``configure_model`` under ZeRO-3 (it deep-copies its layer
while ZeRO-3 partitions what is built); a model its parent initialises again in ``configure_model`` starts from the
weights one process gives it; a layer some micro-batches skip is left alone in the steps no rank used it, as one
process leaves it (AdamW with weight decay)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _support import model_shapes as ms
from _support.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_model_shapes.py"


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("zero_model_shapes")
    run_torchrun(SCRIPT, 2, [out], timeout=600)
    return torch.load(out / "result.pt")


def test_an_encoder_that_copies_its_layer_in_configure_model_trains_like_one_process(result: dict[str, Any]) -> None:
    ms.assert_close(
        result["encoder_in_configure_model"],
        ms.encoder_reference(),
        "zero3, configure_model",
        ms.EncoderRegressor(),
        "head.weight",
    )


def test_initialisations_of_built_layers_apply_to_the_whole_parameters(result: dict[str, Any]) -> None:
    ms.assert_initialized_as_one_process(result["reinitialized"], "configure_model")


@pytest.mark.parametrize("name", ms.SKIP_STRATEGIES)
def test_a_layer_some_steps_skip_is_left_alone_like_one_process(result: dict[str, Any], name: str) -> None:
    """Skipped in whole windows and in a window's first micro-batch only, trained with AdamW and weight decay: in the
    window no rank used it one process neither decays it nor moves its moments, and afterwards its own step count is
    one behind. ZeRO used to step it on a zero gradient (and ZeRO-3 and ZeRO-2 with offload on its gradient of an
    earlier window)."""
    ms.assert_close(result[f"skipped_{name}"], ms.skip_reference(), name, ms.SometimesSkipped(), "skippable.weight")


def test_the_steps_a_layer_was_skipped_are_saved_and_resumed(result: dict[str, Any]) -> None:
    """Resumed by a new Trainer right after the window that skipped the layer: the next window steps it with its own
    Adam step count, which only the checkpoint knows."""
    ms.assert_close(
        result["resumed_zero2"], ms.skip_reference(), "zero2, resumed", ms.SometimesSkipped(), "skippable.weight"
    )
