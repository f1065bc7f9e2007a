"""The world an external launcher started against the one a front end asks for (core, shared by the Trainer and
Fabric): Lightning's environments recognised, torchrun's and SLURM's layouts checked, no launcher no check."""

from __future__ import annotations

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment

from lightspeed.core.errors import WorldSizeMismatchError
from lightspeed.core.reliability.launched_world import check_launched_world, external_launcher


def test_external_launcher_recognises_torchrun_and_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("SLURM_NTASKS", "6")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "3")
    assert external_launcher(TorchElasticEnvironment()) == ("torchrun", 4)
    assert external_launcher(SLURMEnvironment()) == ("slurm", 6)
    assert external_launcher(LightningEnvironment()) == (None, 0)  # Lightning starts the processes itself
    assert external_launcher(None) == (None, 0)


def test_torchrun_layout_must_match(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_launched_world("torchrun", 4, num_nodes=2, num_processes=2)
    with pytest.raises(WorldSizeMismatchError) as raised:
        check_launched_world("torchrun", 2, num_nodes=2, num_processes=2, front_end="Fabric")
    assert str(raised.value) == (
        "`Fabric(num_nodes=2, devices=2)` asks for 4 processes, but torchrun started 2 (1 node(s) x 2 per node: "
        "WORLD_SIZE=2, LOCAL_WORLD_SIZE=2). Set `Fabric(num_nodes=1, devices=2)`, or start torchrun with "
        "`--nnodes 2 --nproc-per-node 2`."
    )


def test_slurm_layout_must_match(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "3(x2)")
    check_launched_world("slurm", 6, num_nodes=2, num_processes=3)
    with pytest.raises(WorldSizeMismatchError) as raised:
        check_launched_world("slurm", 6, num_nodes=3, num_processes=2)
    assert str(raised.value) == (
        "`Trainer(num_nodes=3, devices=2)` asks for 6 processes, but SLURM started 6 tasks (SLURM_NNODES=2, "
        "SLURM_NTASKS_PER_NODE=3). Make `num_nodes` equal `#SBATCH --nodes` and `devices` equal "
        "`#SBATCH --ntasks-per-node`."
    )


def test_no_external_launcher_no_check() -> None:
    check_launched_world(None, 0, num_nodes=8, num_processes=8)
