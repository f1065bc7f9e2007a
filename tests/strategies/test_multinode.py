"""Two nodes x two processes on one machine over loopback (one torchrun per node, each in its own working
directory), compared with one node x four processes; node-local checkpoints (each node its own directory), their
resume and export; a Trainer whose num_nodes disagrees with the launcher."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _support.launch import REPO_ROOT, child_env, free_port, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "multinode.py"


def torchrun_nodes(root: Path, mode: str, shared: Path, timeout: float = 900) -> list[subprocess.CompletedProcess]:
    """The README's recipe: `torchrun --nnodes 2 --node-rank N --nproc-per-node 2 --master-addr 127.0.0.1 ...`, one
    per node, each started in its own working directory ``root/node<N>``."""
    port = free_port()
    procs = []
    for node in range(2):
        cwd = root / f"node{node}"
        cwd.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
            "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
            str(SCRIPT), mode, str(shared), "2",
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(cmd, cwd=cwd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("multinode")
    shared = root / "shared"
    for node, result in enumerate(torchrun_nodes(root, "train", shared)):
        assert result.returncode == 0, f"node {node} failed:\n{result.stdout[-8000:]}"
    return root


def test_two_nodes_end_with_the_weights_of_one_node_with_four_processes(runs: Path, one_node_of_four: Path) -> None:
    two = torch.load(runs / "shared" / "weights_2x2.pt")
    one = torch.load(one_node_of_four / "weights_1x4.pt")
    assert json.loads((runs / "shared" / "facts.json").read_text())["global_step"] == 8
    for name, reference in (("zero2_offload", "zero2_offload"), ("zero3_node_local", "zero3")):
        for key, expected in one[reference].items():
            diff = (two[name][key] - expected).abs().max().item()
            # zero2_offload: checkpoint on the shared dir + resume; zero3: node-local checkpoint + resume
            assert diff <= 1e-6, f"{name} {key}: 2 nodes x 2 differ from 1 node x 4 by {diff:.3e}"


def test_node_local_checkpoint_keeps_each_nodes_ranks_in_its_own_directory(runs: Path) -> None:
    for node, ranks in ((0, [0, 1]), (1, [2, 3])):
        ckpt = runs / f"node{node}" / "ckpt" / "last.ckpt"
        names = sorted(p.name for p in (ckpt / "checkpoint").iterdir())
        assert names == [f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in ranks for kind in ("model", "optim")]
        assert (ckpt / "latest").read_text() == "checkpoint" and (ckpt / "ds_config.json").is_file()
        record = json.loads((ckpt / "lightspeed_complete.json").read_text())
        assert record["node_local"]["node_rank"] == node and record["node_local"]["ranks_per_node"] == {
            "0": [0, 1],
            "1": [2, 3],
        }
        assert record["global_step"] == 8
        # node 1 had a stale staging area from a crashed save: swept by the resumed run's first save
        assert not list((runs / f"node{node}" / "ckpt").glob("*staging*"))
    markers = [runs / f"node{n}/ckpt/last.ckpt/lightspeed_complete.json" for n in (0, 1)]
    assert len({json.loads(m.read_text())["node_local"]["save_id"] for m in markers}) == 1


def export(*args: str | Path) -> int:
    """``lightspeed export ARGS`` (the command line's own entry point, in this process)."""
    from lightspeed.cli.main import main

    return main(["export", "--quiet", *map(str, args)])


def test_export_from_every_nodes_directory_equals_the_shared_checkpoint_export(
    runs: Path, one_node_of_four: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(runs)
    assert export("node0/ckpt/last.ckpt", "node1/ckpt/last.ckpt", "out_node_local") == 0
    assert export(str(one_node_of_four / "ckpt" / "last.ckpt"), "out_shared") == 0  # 1 node x 4, one directory
    written = (runs / "out_node_local" / "model.safetensors").read_bytes()
    assert written == (runs / "out_shared" / "model.safetensors").read_bytes()

    from lightspeed.export import export_checkpoint

    export_checkpoint([runs / "node1/ckpt/last.ckpt", runs / "node0/ckpt/last.ckpt"], runs / "out_library")
    assert (runs / "out_library" / "model.safetensors").read_bytes() == written


def test_export_with_a_node_missing_exits_2_naming_the_node_and_ranks(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert export(runs / "node0/ckpt/last.ckpt", tmp_path / "out") == 2
    assert "saved by 2 nodes, but the directory of node(s) 1 (ranks 2, 3) was not given" in capsys.readouterr().err
    damaged = tmp_path / "node1"
    shutil.copytree(runs / "node1/ckpt/last.ckpt", damaged)
    (damaged / "checkpoint" / "zero_pp_rank_3_mp_rank_00_optim_states.pt").unlink()
    assert export(runs / "node0/ckpt/last.ckpt", damaged, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"node 1's checkpoint directory '{damaged}' is missing the files of rank(s) 3" in err
    assert not (tmp_path / "out").exists()


def test_resume_with_a_nodes_files_missing_fails_before_any_step(runs: Path, tmp_path: Path) -> None:
    for node in (0, 1):
        shutil.copytree(runs / f"node{node}" / "ckpt", tmp_path / f"node{node}" / "ckpt")
    (tmp_path / "node1/ckpt/last.ckpt/checkpoint/zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    results = torchrun_nodes(tmp_path, "resume", tmp_path / "shared", timeout=600)
    assert all(r.returncode != 0 for r in results)
    both = "\n".join(r.stdout for r in results)
    assert "node 1's checkpoint directory" in both and "is missing the files of rank(s) 2" in both
    assert "Copy them back from where node 1 saved them, or resume from an earlier checkpoint." in both
    assert not (tmp_path / "shared" / "weights_2x2.pt").exists()


def test_num_nodes_that_disagrees_with_torchrun_is_one_clear_error(tmp_path: Path) -> None:
    run_torchrun(SCRIPT, 2, ["mismatch", tmp_path, "2"])
    for rank in (0, 1):
        message = (tmp_path / f"mismatch_rank{rank}.txt").read_text()
        assert message == (
            "WorldSizeMismatchError: `Trainer(num_nodes=2, devices=2)` asks for 4 processes, but torchrun started 2 "
            "(1 node(s) x 2 per node: WORLD_SIZE=2, LOCAL_WORLD_SIZE=2). Set `Trainer(num_nodes=1, devices=2)`, or "
            "start torchrun with `--nnodes 2 --nproc-per-node 2`."
        )
