"""Resuming on another number of processes: a checkpoint written by 4 processes continues on 2, one written by 2
continues on 3, for ZeRO 1, 2 and 3 with and without CPU optimizer offload (optimizer state included) and for a block
registered twice in one parent (ZeRO 2 and 3), and the continued run equals the run continued on the original number
of processes with the same global batch. The same for a Fabric loop (``fabric.save`` / ``fabric.load``), ZeRO 1, 2
and 3."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from _elastic import failure, run_elastic

from _support.models import make_net

CONFIGS = ["s1", "s2", "s3", "s1_offload", "s2_offload", "s3_offload", "s2_shared", "s3_shared"]
GLOBAL_BATCH = 12
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, str]]:
    out = tmp_path_factory.mktemp("reshard")
    outputs = {}
    for nproc, actions in ((4, ["write:w4"]), (2, ["resume:w4", "write:w2"]), (3, ["resume:w2"])):
        proc = run_elastic("reshard.py", nproc, [out, GLOBAL_BATCH, *actions], max_restarts=0, timeout=900)
        assert proc.returncode == 0, failure(proc)
        outputs[nproc] = proc.stdout + proc.stderr
    return out, outputs


def _assert_resharded_continuation(
    folder: Path, resumed_file: str, output: str, written: int, resumed: int, config: str
) -> dict[str, torch.Tensor]:
    """The weights saved in ``folder / resumed_file`` equal the uninterrupted run's (``reference.pt``); the run said
    once that it converted the checkpoint of ``written`` processes for its ``resumed`` and removed the converted
    copy. Returns the resumed weights."""
    reference, continued = torch.load(folder / "reference.pt"), torch.load(folder / resumed_file)
    assert reference.keys() == continued.keys()
    for key, expected in reference.items():
        diff = (continued[key] - expected).abs().max().item()
        assert diff <= TOLERANCE, f"{config} {written}->{resumed}: {key} differs by {diff:.3e}"
    line = (
        f"lightspeed: checkpoint {str(folder / 'ckpt')!r} was written by {written} processes, this run has {resumed}: "
        "converted it through DeepSpeed's universal checkpoint format (weights and optimizer states) and loaded it."
    )
    assert output.count(line) == 1
    assert not list(folder.glob("*.lightspeed-universal"))  # the converted copy is removed after loading
    return continued


@pytest.mark.parametrize(("written", "resumed"), [(4, 2), (2, 3)])
@pytest.mark.parametrize("config", CONFIGS)
def test_the_run_continued_on_another_world_size_equals_the_original_continuation(
    runs: tuple[Path, dict[int, str]], written: int, resumed: int, config: str
) -> None:
    out, outputs = runs
    folder = out / f"w{written}" / config
    continued = _assert_resharded_continuation(folder, "resumed.pt", outputs[resumed], written, resumed, config)
    if config.endswith("shared"):  # the block registered twice is one tensor after resharding too
        assert torch.equal(continued["net.2.weight"], continued["net.4.weight"])


def test_resuming_changes_the_weights_so_the_comparison_is_not_vacuous(runs: tuple[Path, dict[int, str]]) -> None:
    from _support.models import make_net

    out, outputs = runs
    start = make_net().state_dict()["0.weight"]
    assert (torch.load(out / "w4" / "s2" / "resumed.pt")["net.0.weight"] - start).abs().max() > 1e-3
    assert not re.search(r"lightspeed: checkpoint .* written by 4 processes, this run has 4", outputs[4])


FABRIC_CONFIGS = ["s1", "s2", "s3"]


@pytest.fixture(scope="module")
def fabric_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, str]]:
    out = tmp_path_factory.mktemp("reshard_fabric")
    outputs = {}
    for nproc, actions in ((4, ["write:w4"]), (2, ["resume:w4"]), (3, ["resume:w4"])):
        args = ["reshard", out, GLOBAL_BATCH, *actions]
        proc = run_elastic("fabric_loop.py", nproc, args, max_restarts=0, timeout=900)
        assert proc.returncode == 0, failure(proc)
        outputs[nproc] = proc.stdout + proc.stderr
    return out, outputs


@pytest.mark.parametrize("resumed", [2, 3])
@pytest.mark.parametrize("config", FABRIC_CONFIGS)
def test_a_fabric_loop_continued_on_another_world_size_equals_the_original_continuation(
    fabric_runs: tuple[Path, dict[int, str]], resumed: int, config: str
) -> None:
    out, outputs = fabric_runs
    folder = out / "w4" / config
    continued = _assert_resharded_continuation(folder, f"resumed_{resumed}.pt", outputs[resumed], 4, resumed, config)
    start = make_net().state_dict()["0.weight"]
    assert (continued["0.weight"] - start).abs().max() > 1e-3  # the comparison is not vacuous
