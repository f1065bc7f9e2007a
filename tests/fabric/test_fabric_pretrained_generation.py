"""A pretrained HuggingFace causal LM in a Fabric loop under ZeRO-3 (2 CPU ranks): ``from_pretrained`` inside
``fabric.init_module()`` builds it straight into partitions with the files' exact weights, and ``generate`` on the
model ``fabric.setup_module`` returned finishes when the ranks stop at different steps, without ``synced_gpus``, with
the tokens of single-process generation; ``synced_gpus=False`` is a clear error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from _support.pretrained_generation import (
    check_bad_pretrained_directory,
    check_built_into_partitions,
    check_generation,
    run_front_end,
)


@pytest.fixture(scope="module")
def fabric_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[list[int]], Path]:
    out = tmp_path_factory.mktemp("zero_pretrained_fabric")
    return (*run_front_end(out, "fabric"), out)


def test_from_pretrained_in_init_module_builds_into_partitions(fabric_run: Any) -> None:
    check_built_into_partitions(fabric_run[0])


def test_generation_where_ranks_stop_at_different_steps_equals_one_process(fabric_run: Any) -> None:
    facts, expected, _ = fabric_run
    check_generation(facts, expected, ("validation",))


def test_a_pretrained_directory_that_does_not_fit_is_one_error_naming_the_tensors_on_every_rank(
    fabric_run: Any,
) -> None:
    facts, _, out = fabric_run
    check_bad_pretrained_directory(out, facts)
