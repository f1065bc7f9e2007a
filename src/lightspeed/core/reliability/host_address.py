"""Every host must be reachable at the address gloo gives the others for it: checked before the group connects.

gloo (without ``GLOO_SOCKET_IFNAME``) binds each process to the first address its host's name resolves to, falling
back to the loopback address, and the other processes connect there. Where a host's name resolves to a loopback
address (Debian's ``/etc/hosts`` maps it to ``127.0.1.1``) or to nothing, the other hosts try that address on their
own machine and the group never connects: the job waits out the process group's timeout and fails with a message
naming neither the host nor the address. So before the group is created, every rank of a job that spans several
hosts publishes, through the rendezvous store, the address gloo would use for it; one loopback address anywhere is a
:class:`~lightspeed.errors.HostAddressError` on every rank, naming the host, its ranks and the address, at start-up.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from datetime import timedelta
from typing import Any

from lightspeed.core.errors import HostAddressError

__all__ = ["check_host_addresses", "gloo_address"]

_KEY = "lightspeed/host_address/"


def gloo_address() -> str:
    """The address gloo binds to on this host: ``GLOO_SOCKET_IFNAME``'s interface when set (reported as such), else
    the first address this host's name resolves to that can be bound, else the loopback address gloo falls back to."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        return f"interface {interface}"
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return "127.0.0.1"
    for family, kind, _, _, address in infos:
        try:
            with socket.socket(family, kind) as probe:
                probe.bind((address[0], 0))
        except OSError:
            continue
        return str(address[0])
    return "127.0.0.1"


def check_host_addresses(store: Any, rank: int, world_size: int, timeout: timedelta) -> None:
    """Publish this rank's :func:`gloo_address`; rank 0 reads every rank's and publishes the verdict, and every rank
    raises :class:`HostAddressError` when a host's is a loopback address while the job spans several hosts (a
    collective through ``store``, before the group exists: one write and one read per rank, ``world_size`` reads on
    rank 0)."""
    store.set(f"{_KEY}{rank}", json.dumps([socket.gethostname(), gloo_address()]))
    if rank == 0:
        keys = [f"{_KEY}{other}" for other in range(world_size)]
        store.wait(keys, timeout)
        store.set(f"{_KEY}verdict", _verdict([json.loads(store.get(key)) for key in keys]))
    store.wait([f"{_KEY}verdict"], timeout)
    problem = store.get(f"{_KEY}verdict").decode()
    if problem:
        raise HostAddressError(problem)


def _verdict(by_rank: list[list[str]]) -> str:
    """The error message for the first host whose address is loopback in a job over several hosts, else ``""``."""
    hosts: dict[tuple[str, str], list[int]] = {}
    for rank, (name, address) in enumerate(by_rank):
        hosts.setdefault((name, address), []).append(rank)
    if len({name for name, _ in hosts}) < 2:
        return ""  # one host: its loopback address reaches every rank
    for (name, address), ranks in hosts.items():
        if _is_loopback(address):
            return (
                f"Host {name!r} (rank(s) {', '.join(map(str, ranks))}) would be reached at {address}, the address its "
                f"hostname {name!r} resolves to there: a loopback address, which the other hosts cannot reach, so the "
                "process group could never connect. Make the name resolve to the address the other hosts reach it at "
                "(its line in /etc/hosts), or set GLOO_SOCKET_IFNAME to the interface that faces them (e.g. "
                "GLOO_SOCKET_IFNAME=eth0) on every host."
            )
    return ""


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # "interface eth0"
        return False
