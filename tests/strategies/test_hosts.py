"""Two simulated hosts (tests/_support/hosts.py: network namespaces joined by a veth pair, each with its own hostname,
address in 198.18.0.0/15, /etc/hosts and node-local disk), one torchrun per host with 2 processes, rendezvous on the
first host by name: they end with the weights of one host with 4 processes (zero3, zero2_offload), also over a link
that loses 0.5 % of its packets; each rank runs under its own host's name; node-local checkpoints stay on each host's
own disk. Skipped where the namespaces cannot be made (not root)."""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from _support.hosts import INTERFACE, SimulatedHosts, require_namespaces, simulated_hosts
from _support.launch import NATIVE_ABORT, REPO_ROOT, child_env, free_port, run_torchrun
from lightspeed.core.reliability.node_local import check_parts, require_part

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "multinode.py"
ADDRESSES = {"host-a": "198.18.0.1", "host-b": "198.18.0.2"}


@dataclass
class HostsRun:
    """What one launch on the simulated hosts left: the shared directory, each host's disk, what its link carried."""

    shared: Path
    disks: dict[str, Path]
    local: Path
    link: dict[str, dict[str, int]]

    def weights(self, tag: str) -> dict[str, dict[str, torch.Tensor]]:
        return torch.load(self.shared / f"weights_{tag}.pt")

    def facts(self, tag: str) -> list[dict]:
        return [json.loads((self.shared / f"{tag}_rank{rank}.json").read_text()) for rank in range(4)]


def launch_on_hosts(sim: SimulatedHosts, shared: Path, runs: str, tag: str) -> None:
    """`torchrun --nnodes 2 --node-rank N --nproc-per-node 2 --master-addr host-a ...` on each host (a second time
    after a rank aborted in native code, as run_launch does)."""
    for attempt in range(2):
        port = free_port()  # any port: nothing else listens in a fresh namespace
        procs = []
        for node, host in enumerate(sim.hosts):
            argv = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                "--nproc-per-node", "2", "--master-addr", sim.hosts[0].name, "--master-port", str(port),
                str(SCRIPT), "hosts", str(shared), "2", runs, tag,
            ]  # fmt: skip
            procs.append(sim.popen(host, argv, child_env(), shared.parent / f"{tag}_{host.name}_{attempt}.log"))
        try:
            for proc in procs:
                proc.wait(timeout=300)
        finally:
            for proc in procs:
                proc.kill()  # only after a timeout: a torchrun still running (its ranks end with the namespaces)
        outputs = [(shared.parent / f"{tag}_{host.name}_{attempt}.log").read_text() for host in sim.hosts]
        ends = zip(sim.hosts, procs, outputs, strict=True)
        failed = [(host.name, out) for host, proc, out in ends if proc.returncode]
        if not failed:
            return
        if attempt == 0 and any(NATIVE_ABORT in out for _, out in failed):
            warnings.warn(f"{tag}: a rank aborted in native code ({NATIVE_ABORT!r}); launching again", stacklevel=2)
            continue
        raise AssertionError("\n".join(f"{name} failed:\n{out[-6000:]}" for name, out in failed))


def run_on_hosts(root: Path, runs: str, tag: str, link: str | None = None) -> HostsRun:
    with simulated_hosts(root, link=link) as sim:
        launch_on_hosts(sim, root / "shared", runs, tag)
        stats = sim.link_stats()
        disks = {host.name: host.disk for host in sim.hosts}
        return HostsRun(root / "shared", disks, sim.local, stats)


@pytest.fixture(scope="module", autouse=True)
def namespaces() -> None:
    """Skip every test here at once where no namespace can be made (not root), before the one-host reference run."""
    require_namespaces()


@pytest.fixture(scope="module")
def one_host(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """The same runs with 4 processes on this machine (zero2_offload, zero3), uninterrupted."""
    shared = tmp_path_factory.mktemp("one_host")
    run_torchrun(SCRIPT, 4, ["reference", shared, "1"])
    return torch.load(shared / "weights_1x4.pt")


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> HostsRun:
    """zero3 with node-local checkpoints (1 epoch, resumed to 2), then zero2_offload, on 2 hosts x 2 processes."""
    return run_on_hosts(tmp_path_factory.mktemp("two_hosts"), "zero3_node_local,zero2_offload", "plain")


def assert_same_weights(two: dict[str, torch.Tensor], one: dict[str, torch.Tensor], what: str) -> None:
    assert two.keys() == one.keys()
    for key, expected in one.items():
        diff = (two[key] - expected).abs().max().item()
        assert diff <= 1e-6, f"{what} {key}: 2 hosts x 2 differ from 1 host x 4 by {diff:.3e}"


@pytest.mark.parametrize(("run", "reference"), [("zero3_node_local", "zero3"), ("zero2_offload", "zero2_offload")])
def test_two_hosts_end_with_the_weights_of_one_host_with_four_processes(
    two_hosts: HostsRun, one_host: dict, run: str, reference: str
) -> None:
    assert_same_weights(two_hosts.weights("plain")[run], one_host[reference], run)


def test_each_rank_runs_under_its_hosts_name_and_rendezvous_on_the_first_host_over_the_link(
    two_hosts: HostsRun,
) -> None:
    facts = two_hosts.facts("plain")
    for rank, seen in enumerate(facts):
        host = "host-a" if rank < 2 else "host-b"
        assert seen == {
            "hostname": host,
            "address": ADDRESSES[host],
            "master_addr": "host-a",
            "master_address": ADDRESSES["host-a"],
            "node_rank": rank // 2,
            "local_rank": rank % 2,
            "world_size": 4,
            "global_step": 8,
        }, f"rank {rank}"
    # the hosts reach each other only through the veth pair: the collectives crossed it both ways
    for host, stats in two_hosts.link.items():
        assert stats["tx_bytes"] > 100_000, f"{host}'s {INTERFACE} sent only {stats}"


def test_node_local_checkpoints_stay_on_each_hosts_own_disk(two_hosts: HostsRun) -> None:
    """Both hosts saved to the same path (./ckpt on their node-local disk): each disk holds only its own ranks' shards
    and its committed part of the save (with the files every node needs), the two parts make one save, and neither the
    mount point nor the shared directory got a checkpoint file."""
    parts = []
    for node, (host, ranks) in enumerate((("host-a", [0, 1]), ("host-b", [2, 3]))):
        disk = two_hosts.disks[host]
        ckpt = disk / "ckpt" / "last.ckpt"
        shards = sorted(p.name for p in disk.rglob("zero_pp_rank_*"))
        assert shards == [f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in ranks for kind in ("model", "optim")]
        assert all(ckpt in p.parents for p in disk.rglob("*") if p.is_file()), f"{host} wrote outside ./ckpt"
        part = require_part(ckpt, node)  # committed, with every file of this host's ranks and the common ones
        assert (part.node_rank, part.ranks_per_node, part.global_step) == (node, {0: [0, 1], 1: [2, 3]}, 4)
        parts.append(part)
    check_parts(parts)  # one save, every node's part once
    assert list(two_hosts.local.iterdir()) == []
    assert sorted(p.name for p in two_hosts.shared.iterdir()) == [f"plain_rank{r}.json" for r in range(4)] + [
        "weights_plain.pt"
    ]


@pytest.mark.parametrize("link", ["netem", "bpf-loss"])
def test_zero3_over_a_lossy_link_ends_with_the_weights_of_one_host(
    tmp_path_factory: pytest.TempPathFactory, one_host: dict, link: str
) -> None:
    """netem: delay 5 ms and 0.5 % loss on both ends (skipped where the kernel has no netem); bpf-loss: the same loss
    without netem (a tc filter drops one packet in 200). The link did drop packets (TCP sent them again)."""
    result = run_on_hosts(tmp_path_factory.mktemp(f"link_{link}"), "zero3", link, link=link)
    assert_same_weights(result.weights(link)["zero3"], one_host["zero3"], f"zero3 over the {link} link")
    assert sum(stats["dropped"] for stats in result.link.values()) > 0, f"the link lost no packet: {result.link}"
