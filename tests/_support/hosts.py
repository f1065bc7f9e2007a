"""Simulated hosts on one machine: two network namespaces joined by a veth pair, each host with its own hostname (a
UTS namespace), address (the benchmarking range 198.18.0.0/15, never routed), ``/etc/hosts`` and node-local disk.

Each host sees the other only through its ``eth0`` (the veth end); neither can reach this machine's loopback. A
command runs on a host as ``ip netns exec NS unshare --uts --mount sh -c 'hostname NAME; mount --bind DISK LOCAL;
cd LOCAL; exec ...'``: ``ip netns exec`` bind-mounts ``/etc/netns/NS/hosts`` over ``/etc/hosts``; ``LOCAL`` is the
same path on every host, backed by each host's own directory (``Host.disk``), so a file one host writes there is never
seen by the other. The venv and the repository are on the shared filesystem, as a cluster's home directory would be.

:func:`simulated_hosts` skips the test (with the reason) where the namespaces cannot be made: not root, no ``ip`` or
``unshare``, or a step refused for lack of privileges. ``link`` impairs the link on both ends:

* ``"netem"``: ``tc qdisc add dev eth0 root netem delay 5ms loss 0.5%``; skipped where the kernel has no netem
  qdisc (``CONFIG_NET_SCH_NETEM``);
* ``"bpf-loss"``: the same 0.5 % loss without netem: an htb root whose classic-BPF filter (``ld rand``) sends one
  packet in 200 to a class whose ``pfifo limit 0`` drops it (no delay: only netem adds one).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

INTERFACE = "eth0"
PREFIX = "198.18.0"  # RFC 2544 benchmarking range: never routed
NETEM = "delay 5ms loss 0.5%"
#: classic BPF: ``ld rand; jgt #(0.005 * 2**32), 0, 1; ret #0; ret #-1``: one packet in 200 matches (goes to the
#: dropping class), the others do not (htb's default class)
_BPF_LOSS = "4,32 0 0 4294963256,37 0 1 21474836,6 0 0 0,6 0 0 4294967295"
#: a step refused for lack of privileges, or a kernel without the feature: the test is skipped, not failed
_REFUSED = re.compile(
    r"operation not permitted|permission denied|must be root|not supported|kind is unknown|unknown filter", re.I
)


@dataclass(frozen=True)
class Host:
    """One simulated host: hostname, network namespace, address on the link, and the directory behind its
    node-local disk."""

    name: str
    namespace: str
    address: str
    disk: Path


@dataclass
class SimulatedHosts:
    """The hosts of one :func:`simulated_hosts` block and how to run commands on them."""

    hosts: list[Host]
    local: Path  #: where every host sees its own disk (the same path on each)
    link: str | None

    def command(self, host: Host, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on ``host``: in its namespaces, under its hostname, in ``local`` (its own disk)."""
        script = 'hostname "$1" && mount --bind "$2" "$3" && cd "$3" && shift 3 && exec "$@"'
        return [
            "ip", "netns", "exec", host.namespace, "unshare", "--uts", "--mount", "sh", "-c", script, "host",
            host.name, str(host.disk), str(self.local), *map(str, argv),
        ]  # fmt: skip

    def popen(self, host: Host, argv: Sequence[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` in its own process group, its output (both streams) into ``log``; gloo binds
        the host's ``eth0`` (unless ``env`` sets ``GLOO_SOCKET_IFNAME`` to ``""``: then it is not set at all)."""
        full = {"GLOO_SOCKET_IFNAME": INTERFACE, **env}
        with log.open("wb") as out:
            return subprocess.Popen(
                self.command(host, argv),
                env={key: value for key, value in full.items() if key != "GLOO_SOCKET_IFNAME" or value},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def cut(self, host: Host) -> None:
        """Cut ``host`` off the link: its ``eth0`` down (packets to it and from it are lost; no reset reaches either
        end, as when a cable is pulled or a switch port dies)."""
        _ip("-n", host.namespace, "link", "set", INTERFACE, "down")

    def reconnect(self, host: Host) -> None:
        """Put ``host`` back on the link (its ``eth0`` up again, addresses and routes as before the cut)."""
        _ip("-n", host.namespace, "link", "set", INTERFACE, "up")

    def pids(self, host: Host) -> list[int]:
        """The processes running in ``host``'s network namespace."""
        return namespace_pids(host.namespace)

    def link_stats(self) -> dict[str, dict[str, int]]:
        """Per host, what its ``eth0`` sent (``tx_packets``, ``tx_bytes``) and what its link qdiscs dropped."""
        stats = {}
        for host in self.hosts:
            base = Path("/sys/class/net") / INTERFACE / "statistics"
            counters = _ip(
                "netns", "exec", host.namespace, "cat", str(base / "tx_packets"), str(base / "tx_bytes")
            ).split()
            qdiscs = _ip("netns", "exec", host.namespace, "tc", "-s", "qdisc", "show", "dev", INTERFACE)
            leaves = [int(n) for n in re.findall(r"dropped (\d+)", qdiscs)]
            stats[host.name] = {
                "tx_packets": int(counters[0]),
                "tx_bytes": int(counters[1]),
                "dropped": max(leaves, default=0),
            }
        return stats


class _Refused(Exception):
    """A set-up step failed for lack of privileges or a kernel feature: the test is skipped with this reason."""


def _ip(*args: str) -> str:
    argv = ["ip", *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        message = f"`{' '.join(argv)}` failed: {(proc.stderr or proc.stdout).strip()}"
        if _REFUSED.search(proc.stderr or ""):
            raise _Refused(message)
        raise RuntimeError(message)
    return proc.stdout


def _impair(namespace: str, link: str) -> None:
    tc = ["netns", "exec", namespace, "tc"]
    if link == "netem":
        try:
            _ip(*tc, "qdisc", "add", "dev", INTERFACE, "root", "netem", *NETEM.split())
        except _Refused as err:
            if "kind is unknown" not in str(err):
                raise
            raise _Refused(f"no netem link: {err} (a kernel without the netem qdisc, CONFIG_NET_SCH_NETEM)") from None
    elif link == "bpf-loss":
        _ip(*tc, "qdisc", "add", "dev", INTERFACE, "root", "handle", "1:", "htb", "default", "1", "r2q", "100000")
        for cls in ("1:1", "1:2"):
            _ip(*tc, "class", "add", "dev", INTERFACE, "parent", "1:", "classid", cls, "htb", "rate", "10gbit")
        _ip(*tc, "qdisc", "add", "dev", INTERFACE, "parent", "1:2", "handle", "20:", "pfifo", "limit", "0")
        _ip(*tc, "filter", "add", "dev", INTERFACE, "parent", "1:", "bpf", "bytecode", _BPF_LOSS, "flowid", "1:2")
    else:
        raise ValueError(f"unknown link {link!r}: 'netem' or 'bpf-loss'")


def namespace_pids(namespace: str) -> list[int]:
    """The processes running in network namespace ``namespace`` (``ip netns pids``)."""
    proc = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=60)
    return [int(pid) for pid in proc.stdout.split()]


def _end_processes(namespace: str) -> None:
    """Kill what is left running in ``namespace`` (processes the test started there), by pid."""
    for pid in namespace_pids(namespace):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def require_namespaces() -> None:
    """Skip the test at once where :func:`simulated_hosts` would skip it for want of privileges or tools (a
    namespace made and removed again), before any other work."""
    if os.geteuid() != 0:
        pytest.skip("simulated hosts need root (network namespaces, veth pairs, unshare --uts --mount)")
    missing = [tool for tool in ("ip", "unshare", "tc", "mount") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"simulated hosts need {', '.join(missing)} on PATH")
    namespace = f"lightspeed-{os.getpid()}-{os.urandom(3).hex()}-probe"
    try:
        _ip("netns", "add", namespace)
    except _Refused as err:
        pytest.skip(f"cannot simulate hosts here: {err}")
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=60)


@contextmanager
def simulated_hosts(
    root: Path, link: str | None = None, loopback_names: Sequence[str] = ()
) -> Iterator[SimulatedHosts]:
    """Hosts ``host-a`` (198.18.0.1) and ``host-b`` (198.18.0.2) joined by a veth pair (``link``: see the module),
    their disks under ``root``; removed again when the block ends, also when it fails. A host in ``loopback_names``
    resolves its own name to 127.0.1.1 (as Debian's /etc/hosts does). Skips the test where they cannot be made."""
    require_namespaces()
    tag = f"lightspeed-{os.getpid()}-{os.urandom(3).hex()}"  # unique: tests may run side by side
    hosts = [Host(f"host-{c}", f"{tag}-{c}", f"{PREFIX}.{i + 1}", root / f"disk-host-{c}") for i, c in enumerate("ab")]
    local = root / "local"
    local.mkdir(parents=True, exist_ok=True)
    created: list[Host] = []
    etc = [Path("/etc/netns") / host.namespace for host in hosts]
    reason = None
    try:
        try:
            for host in hosts:
                _ip("netns", "add", host.namespace)
                created.append(host)
            a, b = hosts
            _ip(
                "link", "add", INTERFACE, "netns", a.namespace, "type", "veth",
                "peer", "name", INTERFACE, "netns", b.namespace,
            )  # fmt: skip
            for host, folder in zip(hosts, etc, strict=True):
                names = "".join(
                    f"{'127.0.1.1' if h is host and h.name in loopback_names else h.address} "
                    f"{h.name}.lightspeed.test {h.name}\n"
                    for h in hosts
                )
                host.disk.mkdir(parents=True, exist_ok=True)
                _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", INTERFACE)
                _ip("-n", host.namespace, "link", "set", "lo", "up")
                _ip("-n", host.namespace, "link", "set", INTERFACE, "up")
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "hosts").write_text(f"127.0.0.1 localhost\n::1 localhost\n{names}")
                # no name server is reachable from a host: a name outside /etc/hosts fails at once, never waits
                (folder / "resolv.conf").write_text("# simulated host: no name server\n")
                if link is not None:
                    _impair(host.namespace, link)
        except (_Refused, PermissionError) as err:
            reason = f"cannot simulate hosts here: {err}"
        if reason is None:
            yield SimulatedHosts(hosts, local, link)
    finally:
        for host in created:
            _end_processes(host.namespace)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True, timeout=60)
        for folder in etc:
            shutil.rmtree(folder, ignore_errors=True)
    if reason is not None:
        pytest.skip(reason)
