"""Model shapes users build every day under Fabric's ZeRO strategies, against one plain process (fp32, 2 CPU ranks,
<= 1e-5): an ``nn.TransformerEncoder`` built under ``fabric.init_module()`` with ZeRO-3, with and without offload (it
deep-copies its layer while ZeRO-3 partitions what is built); a model its parent initialises again once built starts
from the weights one process gives it; a layer some micro-batches skip is left alone in the steps no rank used it, as
one process leaves it (AdamW with weight decay; also across a checkpoint), or refused with an optimizer lightspeed
cannot make exact."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _support import model_shapes as ms
from _support.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "fabric" / "scripts" / "fabric_model_shapes.py"
NAMES = ["zero3", "zero3_offload"]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fabric_model_shapes")
    run_torchrun(SCRIPT, 2, [out, ",".join(NAMES)], timeout=600)
    return torch.load(out / "result.pt")


@pytest.mark.parametrize("name", NAMES)
def test_an_encoder_that_copies_its_layer_under_init_module_trains_like_one_process(
    result: dict[str, Any], name: str
) -> None:
    ms.assert_close(
        result[name], ms.encoder_reference(), f"{name}, fabric.init_module()", ms.EncoderRegressor(), "head.weight"
    )


def test_initialisations_of_built_layers_apply_to_the_whole_parameters(result: dict[str, Any]) -> None:
    """``self.apply(init)``, ``nn.init.orthogonal_``/``kaiming_uniform_`` and ``fill_`` on layers ZeRO-3 already
    partitioned: each used to be a silent no-op on the empty placeholder."""
    ms.assert_initialized_as_one_process(result["reinitialized"], "fabric.init_module()")


@pytest.mark.parametrize("name", ms.SKIP_STRATEGIES)
def test_a_layer_some_steps_skip_is_left_alone_like_one_process(result: dict[str, Any], name: str) -> None:
    """Skipped in whole windows and in a window's first or last micro-batch, trained with AdamW and weight decay: no
    rank used it in window 2, so one process neither decays it nor moves its moments there, and in window 3 its own
    step count is one behind the others'. ZeRO used to step it on a zero gradient (and ZeRO-3 and ZeRO-2 with offload
    on its gradient of an earlier window)."""
    ms.assert_close(result[f"skipped_{name}"], ms.skip_reference(), name, ms.SometimesSkipped(), "skippable.weight")


@pytest.mark.parametrize("name", ["zero2", "zero3_offload"])
def test_the_steps_a_layer_was_skipped_are_saved_and_resumed(result: dict[str, Any], name: str) -> None:
    """Saved right after the window that skipped the layer and resumed in a new engine: the next window steps it
    with its own Adam step count, which only the checkpoint knows."""
    ms.assert_close(result[f"resumed_{name}"], ms.skip_reference(), name, ms.SometimesSkipped(), "skippable.weight")


def test_zero_gradient_mode_steps_unused_parameters_on_a_zero_gradient(result: dict[str, Any]) -> None:
    want = ms.skip_reference(zero_gradient=True)
    ms.assert_close(result["zero_gradient"], want, "zero_gradient", ms.SometimesSkipped(), "skippable.weight")
    skipped_alone = ms.skip_reference()["skippable.weight"]
    assert (want["skippable.weight"] - skipped_alone).abs().max() > 1e-4  # the two modes differ here


def test_sgd_with_momentum_leaves_a_skipped_layer_alone_and_steps_it_when_used_again(result: dict[str, Any]) -> None:
    """SGD's update reads no step count: the skipped layer's pieces are put back, and nothing else is done to it when
    it is used again."""
    want = ms.skip_reference(optimizer_class=torch.optim.SGD)
    ms.assert_close(result["sgd_momentum"], want, "zero2, SGD", ms.SometimesSkipped(), "skippable.weight")


def test_an_optimizer_whose_update_reads_its_step_count_is_refused_at_the_first_skip(result: dict[str, Any]) -> None:
    assert result["nadam"] == (
        "DeepSpeedConfigError: No rank used skippable.bias, skippable.weight in this step (a layer skipped, a head not "
        "chosen, an expert no token reached). One process leaves such parameters and their optimizer state as they "
        "are; under ZeRO lightspeed does the same for SGD (without dampening), RMSprop, Adagrad (without lr_decay), "
        "Adadelta, Adam and AdamW, but not for NAdam, whose update depends on a step count that ZeRO keeps for a whole "
        "flat partition. Use one of those optimizers, or pass unused_parameters='zero_gradient' to the ZeRO strategy "
        "to give unused parameters a step on a zero gradient (not what one process does)."
    )
