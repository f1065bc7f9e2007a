"""Model shapes users build every day under Fabric's ZeRO strategies, against one plain process (fp32, 2 CPU ranks,
<= 1e-5): an ``nn.TransformerEncoder`` built under ``fabric.init_module()`` with ZeRO-3, with and without offload (it
deep-copies its layer while ZeRO-3 partitions what is built); a model its parent initialises again once built starts
from the weights one process gives it; a layer some micro-batches skip gets no gradient left from an earlier step."""

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
def test_a_layer_some_steps_skip_gets_no_stale_gradient(result: dict[str, Any], name: str) -> None:
    """Skipped in whole windows and in a window's first or last micro-batch: ZeRO-3 and ZeRO-2 with offload used to
    apply an older gradient (plain SGD, so one process leaves it exactly where a zero gradient does)."""
    ms.assert_close(result[f"skipped_{name}"], ms.skip_reference(), name, ms.SometimesSkipped(), "skippable.weight")
