"""Two simulated hosts (tests/_support/hosts.py: network namespaces joined by a veth pair, each with its own hostname,
address in 198.18.0.0/15, /etc/hosts and node-local disk), one torchrun per host with 2 processes, rendezvous on the
first host by name: they end with the weights of one host with 4 processes (zero3, zero2_offload), also over a link
that loses 0.5 % of its packets; each rank runs under its own host's name; node-local checkpoints stay on each host's
own disk. A host cut off the link mid-run (its eth0 down), between two steps or inside a checkpoint save, ends the
job on both hosts within a bounded time, each rank with a CollectiveTimeoutError naming the other host's ranks, the
previous checkpoint intact, and relaunched once the link is back it resumes exactly from it; a link down for 2 s
within the timeout leaves the run untouched. Skipped where the namespaces cannot be made
(not root)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from _support.hosts import INTERFACE, Host, SimulatedHosts, require_namespaces, simulated_hosts
from _support.launch import NATIVE_ABORT, REPO_ROOT, child_env, free_port
from _support.models import reference_training
from lightspeed.core.reliability.node_local import check_parts, require_part
from lightspeed.core.reliability.staging import require_intact

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


def start_on_hosts(
    sim: SimulatedHosts,
    args: list[str],
    port: int,
    log: str,
    env: dict[str, str] | None = None,
    *,
    elastic: bool = False,
) -> list[subprocess.Popen[bytes]]:
    """`torchrun --nnodes 2 --node-rank N --nproc-per-node 2 --master-addr host-a ... multinode.py ARGS` on each host,
    its output in ``<log>_<host>.log`` beside the shared directory (``env``: added to the ranks' environment).
    ``elastic``: torchrun's elastic agent instead, a c10d rendezvous on host-a and one restart allowed."""
    procs = []
    for node, host in enumerate(sim.hosts):
        if elastic:
            place = [
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{sim.hosts[0].name}:{port}", "--max-restarts", "1",
                "--monitor-interval", "0.5",
            ]  # fmt: skip
        else:
            place = ["--node-rank", str(node), "--master-addr", sim.hosts[0].name, "--master-port", str(port)]
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", *place,
            str(SCRIPT), *args,
        ]  # fmt: skip
        procs.append(sim.popen(host, argv, child_env(env), sim.local.parent / f"{log}_{host.name}.log"))
    return procs


def wait_for_hosts(sim: SimulatedHosts, procs: list[subprocess.Popen[bytes]], log: str) -> dict[str, str]:
    """Wait for the torchruns :func:`start_on_hosts` started (300 s each) and return each host's ``<log>_<host>.log``.
    A torchrun still running after that is killed (its ranks end with the namespaces)."""
    try:
        for proc in procs:
            proc.wait(timeout=300)
    finally:
        for proc in procs:
            proc.kill()  # only after a timeout
    return {host.name: (sim.local.parent / f"{log}_{host.name}.log").read_text() for host in sim.hosts}


def launch_on_hosts(sim: SimulatedHosts, args: list[str], tag: str) -> None:
    """:func:`start_on_hosts` with ``args`` and wait for both (a second time after a rank aborted in native code, as
    run_launch does)."""
    for attempt in range(2):
        port = free_port()  # any port: nothing else listens in a fresh namespace
        procs = start_on_hosts(sim, args, port, f"{tag}_{attempt}")
        outputs = wait_for_hosts(sim, procs, f"{tag}_{attempt}").values()
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
        launch_on_hosts(sim, ["hosts", str(root / "shared"), "2", runs, tag], tag)
        stats = sim.link_stats()
        disks = {host.name: host.disk for host in sim.hosts}
        return HostsRun(root / "shared", disks, sim.local, stats)


@pytest.fixture(scope="module", autouse=True)
def namespaces() -> None:
    """Skip every test here at once where no namespace can be made (not root), before the one-host reference run."""
    require_namespaces()


@pytest.fixture(scope="module")
def one_host(one_node_of_four: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The same runs with 4 processes on this machine (zero2_offload, zero3), uninterrupted (conftest's, shared)."""
    return torch.load(one_node_of_four / "weights_1x4.pt")


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> HostsRun:
    """zero3 with node-local checkpoints (1 epoch, resumed to 2), then zero2_offload, on 2 hosts x 2 processes."""
    return run_on_hosts(tmp_path_factory.mktemp("two_hosts"), "zero3_node_local,zero2_offload", "plain")


def assert_same_weights(two: dict[str, torch.Tensor], one: dict[str, torch.Tensor], what: str) -> None:
    assert two.keys() == one.keys()
    for key, expected in one.items():
        diff = (two[key] - expected).abs().max().item()
        assert diff <= 1e-6, f"{what} {key}: 2 hosts x 2 differ from the reference by {diff:.3e}"


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


#: the cut test: zero2 with `timeout=` CUT_TIMEOUT seconds (heartbeat every CUT_TIMEOUT / 10 s); after step CUT_STEP
#: every rank sleeps CUT_SLEEP seconds, during which the test takes host-b's eth0 down
CUT_TIMEOUT, CUT_STEP, CUT_SLEEP = 10, 5, 4
#: as tests/strategies/scripts/multinode.py trains them (a checkpoint every CUT_SAVE_EVERY steps)
CUT_STEPS, CUT_SAMPLES, CUT_SAVE_EVERY = 60, 2048, 4
#: the elastic restart test: the step after which the last rank is killed (the last checkpoint before it: step 4's)
ELASTIC_KILL_STEP = 6
#: seconds from the cut until both torchruns must have ended: the sleep, then the next step's collective fails after
#: 2 x timeout (measured: zero2's first error comes two timeouts after the ranks wake), the hang report reads the
#: heartbeats 2 intervals apart (host-a) or gives up on the store after its deadline, min(timeout, 20 s) (host-b,
#: cut off from host-a's store), and 15 s for the exceptions, the exit hooks and torchrun to end the processes: 51 s
CUT_BOUND = CUT_SLEEP + 2 * CUT_TIMEOUT + 2 * (CUT_TIMEOUT / 10) + min(CUT_TIMEOUT, 20) + 15


def stacks(sim: SimulatedHosts, host: Host) -> str:
    """Every Python stack still running on ``host`` (py-spy, where installed): why it did not end."""
    py_spy = Path(sys.executable).with_name("py-spy")
    dumps = []
    for pid in sim.pids(host):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
        except OSError:
            continue  # ended meanwhile
        dump = ""
        if py_spy.exists() and "python" in cmdline:
            argv = [str(py_spy), "dump", "--pid", str(pid)]
            dump = subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout
        dumps.append(f"pid {pid}: {cmdline}\n{dump}")
    return "\n".join(dumps)


@pytest.mark.parametrize("moment", ["between_steps", "in_save"])
def test_a_host_cut_off_the_link_ends_the_job_on_both_hosts_naming_the_other_hosts_ranks(
    tmp_path: Path, moment: str
) -> None:
    """zero2 on 2 hosts x 2 processes; host-b's eth0 goes down (no reset reaches either side) between two steps, or
    inside the step-8 checkpoint save (every rank has written its shard into the staging directory, nothing is
    committed). Both torchruns end, non-zero, within CUT_BOUND: host-a's ranks raise CollectiveTimeoutError naming
    ranks 2, 3 (their heartbeats stopped); host-b's ranks, whose reads of the job's store on host-a would block until
    TCP gives up (many minutes), name ranks 0, 1 and the store that did not answer. No process is left on either
    host; a save cut short left the previous checkpoint intact. The link back, both hosts relaunched with
    ``fit(ckpt_path="last")``: the run resumes from the last checkpoint committed before the cut (step 4's), sweeps
    what the cut save left, and ends equal to one plain process."""
    shared = tmp_path / "shared"
    shared.mkdir()
    port = free_port()
    step, phase = (CUT_STEP, "cut") if moment == "between_steps" else (2 * CUT_SAVE_EVERY, "in_save")
    args = ["cut", str(shared), "2", str(step), str(CUT_TIMEOUT), str(CUT_SLEEP), phase]
    with simulated_hosts(tmp_path) as sim:
        host_b = sim.hosts[1]
        procs = dict(zip(sim.hosts, start_on_hosts(sim, args, port, "cut"), strict=True))
        logs = {host: tmp_path / f"cut_{host.name}.log" for host in sim.hosts}
        ended: dict[str, float] = {}
        try:
            start = time.monotonic()
            while not (shared / "cut_now").exists():
                if any(proc.poll() is not None for proc in procs.values()) or time.monotonic() - start > 180:
                    outputs = "\n".join(f"{h.name}:\n{log.read_text()[-4000:]}" for h, log in logs.items())
                    raise AssertionError(f"the ranks never reached step {step}:\n{outputs}")
                time.sleep(0.1)
            sim.cut(host_b)
            cut = time.monotonic()
            while len(ended) < 2 and time.monotonic() - cut < CUT_BOUND:
                for host, proc in procs.items():
                    if host.name not in ended and proc.poll() is not None:
                        ended[host.name] = time.monotonic() - cut
                time.sleep(0.2)
            hung = [host for host in sim.hosts if host.name not in ended]
            assert not hung, "\n".join(
                f"{host.name} still running {CUT_BOUND:g}s after the cut:\n{stacks(sim, host)}\n"
                f"{logs[host].read_text()[-4000:]}"
                for host in hung
            )
            while any(sim.pids(host) for host in sim.hosts) and time.monotonic() - cut < CUT_BOUND + 5:
                time.sleep(0.2)  # a torchrun that ended has ended its ranks: give the kernel a moment to reap them
            left = {host.name: sim.pids(host) for host in sim.hosts}
        finally:
            for proc in procs.values():
                proc.kill()  # only after a failure: a torchrun still running (its ranks end with the namespaces)
        checkpoints = shared / "cut_ckpt"
        cut_short = sorted(path.name for path in checkpoints.iterdir())
        require_intact(checkpoints / "last.ckpt")  # step 4's, whatever the cut interrupted
        if not left["host-a"] and not left["host-b"]:  # the link back, both hosts relaunched from the last checkpoint
            sim.reconnect(host_b)
            launch_on_hosts(sim, [*args[:-1], "resume"], "resume")
    outputs = {host.name: log.read_text()[-6000:] for host, log in logs.items()}
    assert left == {"host-a": [], "host-b": []}, f"processes left after both torchruns ended: {left}"
    for host, proc in procs.items():
        assert proc.returncode != 0, f"{host.name} ended with 0 after the cut:\n{outputs[host.name]}"
    if moment == "in_save":
        assert cut_short == ["last.ckpt", "last.ckpt.lightspeed-staging"], cut_short  # the step-8 save, uncommitted
    errors = {}
    for rank in range(4):
        path = shared / f"{phase}_rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no error:\n{outputs['host-a' if rank < 2 else 'host-b']}"
        errors[rank] = json.loads(path.read_text())
    store = f"store at host-a:{port}"
    for rank, error in errors.items():
        others, on_b = ("0, 1", True) if rank >= 2 else ("2, 3", False)
        assert error["type"] == "CollectiveTimeoutError", f"rank {rank}: {error}"
        assert f"ranks {others} did not arrive" in error["message"], f"rank {rank}: {error['message']}"
        said = store in error["message"] and "did not answer" in error["message"]
        assert said == on_b, f"rank {rank} {'does not say' if on_b else 'says'} its {store} did not answer: {error}"
    assert max(ended.values()) <= CUT_BOUND, ended
    resumed = torch.load(shared / "weights_resume.pt")
    assert (resumed["started_at"], resumed["steps"]) == (CUT_SAVE_EVERY, CUT_STEPS)  # step 4: committed before the cut
    assert sorted(path.name for path in checkpoints.iterdir()) == ["last.ckpt"]  # the cut save's leftovers swept
    assert_same_weights(resumed["weights"], cut_reference(), "relaunched after the cut")


def cut_reference() -> dict[str, torch.Tensor]:
    """The cut runs' training in one plain process: the same global batches, uninterrupted."""
    return reference_training(steps=CUT_STEPS, world_size=4, batch=4, n=CUT_SAMPLES)


def test_a_rank_killed_on_one_host_is_restarted_with_every_host_by_torchruns_elastic_agent(tmp_path: Path) -> None:
    """zero2 on 2 hosts x 2 processes under torchrun's elastic agent (c10d rendezvous on host-a, one restart): rank 3,
    on host-b, is killed after step 6. The ranks still running raise RankLostError (naming rank 3, whose heartbeat
    stood still, or the ranks that left before them) and end; both hosts' agents meet in a new rendezvous round and
    start every rank again, each fits with ``ckpt_path="last"``: the run resumes from the step-4 checkpoint and ends
    equal to one plain process."""
    shared = tmp_path / "shared"
    shared.mkdir()
    args = ["cut", str(shared), "2", str(ELASTIC_KILL_STEP), str(CUT_TIMEOUT), "0", "elastic"]
    with simulated_hosts(tmp_path) as sim:
        procs = start_on_hosts(sim, args, free_port(), "elastic", elastic=True)
        outputs = wait_for_hosts(sim, procs, "elastic")
    assert [proc.returncode for proc in procs] == [0, 0], {host: out[-6000:] for host, out in outputs.items()}
    lost = [json.loads((shared / f"elastic_rank{rank}.json").read_text()) for rank in range(3)]
    assert all(error["type"] == "RankLostError" for error in lost), lost
    # rank 3 marked no exit: the ranks that found no mark name it by its heartbeat (its step where it beat after the
    # fit started), the others the ranks that left before them
    silent = [e for e in lost if re.search(r"when rank 3 ended without a word( at step \d+)?, so", e["message"])]
    assert silent and all(e in silent or "left the job" in e["message"] for e in lost), lost
    finished = torch.load(shared / "weights_elastic.pt")
    assert (finished["started_at"], finished["steps"]) == (CUT_SAVE_EVERY, CUT_STEPS)
    assert_same_weights(finished["weights"], cut_reference(), "restarted by torchrun's elastic agent")


def test_a_link_down_for_two_seconds_within_the_timeout_leaves_the_run_untouched(tmp_path: Path) -> None:
    """zero2 on 2 hosts x 2 processes (timeout 10 s); host-b's eth0 down for 2 s between two steps, then up: TCP
    carries on, no error, and the run ends equal to one plain process."""
    shared = tmp_path / "shared"
    shared.mkdir()
    args = ["cut", str(shared), "2", str(CUT_STEP), str(CUT_TIMEOUT), str(CUT_SLEEP), "blip"]
    with simulated_hosts(tmp_path) as sim:
        procs = start_on_hosts(sim, args, free_port(), "blip")
        try:
            start = time.monotonic()
            while not (shared / "cut_now").exists() and time.monotonic() - start < 180:
                time.sleep(0.1)
            sim.cut(sim.hosts[1])
            time.sleep(2)
            sim.reconnect(sim.hosts[1])
            for proc in procs:
                proc.wait(timeout=300)
        finally:
            for proc in procs:
                proc.kill()  # only after a timeout
        outputs = {host.name: (tmp_path / f"blip_{host.name}.log").read_text()[-6000:] for host in sim.hosts}
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    finished = torch.load(shared / "weights_blip.pt")
    assert finished["steps"] == CUT_STEPS and not list(shared.glob("blip_rank*.json"))
    assert_same_weights(finished["weights"], cut_reference(), "a 2 s link drop")


def test_a_host_whose_name_resolves_to_loopback_is_named_on_every_rank_at_start(tmp_path: Path) -> None:
    """host-b's /etc/hosts maps its own name to 127.0.1.1 (Debian's default) and GLOO_SOCKET_IFNAME is not set: gloo
    would give the other host that address, and the group could never connect (without the check the job hangs).
    Every rank raises HostAddressError naming host-b, its ranks and the address, at start-up, well before the process
    group's timeout; both hosts' logs show it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    with simulated_hosts(tmp_path, loopback_names=["host-b"]) as sim:
        started = time.monotonic()
        args = ["hosts", str(shared), "2", "zero2", "loopback"]
        procs = start_on_hosts(sim, args, free_port(), "loopback", env={"GLOO_SOCKET_IFNAME": ""})  # gloo's default
        outputs = wait_for_hosts(sim, procs, "loopback")
        seconds = time.monotonic() - started
    expected = (
        "Host 'host-b' (rank(s) 2, 3) would be reached at 127.0.1.1, the address its hostname 'host-b' resolves to "
        "there: a loopback address, which the other hosts cannot reach, so the process group could never connect. "
        "Make the name resolve to the address the other hosts reach it at (its line in /etc/hosts), or set "
        "GLOO_SOCKET_IFNAME to the interface that faces them (e.g. GLOO_SOCKET_IFNAME=eth0) on every host."
    )
    errors = {rank: shared / f"loopback_error_rank{rank}.json" for rank in range(4)}
    raised = {rank: json.loads(path.read_text()) for rank, path in errors.items() if path.exists()}
    for rank, error in raised.items():
        assert error == {**error, "type": "HostAddressError", "message": expected}, f"rank {rank}: {error}"
    for node, (host, output) in enumerate(outputs.items()):
        # every host has a rank that raised it (its second rank may be stopped by torchrun once the first one
        # failed), and its log shows the message (its ranks' tracebacks interleave there, the message is one write)
        assert {2 * node, 2 * node + 1} & set(raised), f"no rank on {host} raised:\n{output[-6000:]}"
        assert expected in output, f"{host}:\n{output[-6000:]}"
    assert all(proc.returncode != 0 for proc in procs)
    assert seconds < 120, seconds  # the strategy's timeout is Lightning's 30 minutes
