"""The address gloo would give the other hosts for this one, and the verdict over every rank's: a loopback address
is an error only in a job over several hosts, naming the first such host, its ranks and the address."""

from __future__ import annotations

import pytest

from lightspeed.core.reliability import host_address


def test_one_host_may_use_its_loopback_address() -> None:
    assert host_address._verdict([["box", "127.0.1.1"], ["box", "127.0.1.1"]]) == ""


def test_several_hosts_with_routable_addresses_or_an_interface_pass() -> None:
    by_rank = [["a", "198.18.0.1"], ["a", "198.18.0.1"], ["b", "interface eth0"], ["b", "interface eth0"]]
    assert host_address._verdict(by_rank) == ""


def test_a_loopback_address_on_one_of_several_hosts_names_it() -> None:
    by_rank = [["a", "198.18.0.1"], ["b", "::1"], ["b", "::1"]]
    assert host_address._verdict(by_rank).startswith(
        "Host 'b' (rank(s) 1, 2) would be reached at ::1, the address its hostname 'b' resolves to there: a loopback "
        "address, which the other hosts cannot reach"
    )


def test_gloo_address_is_the_interface_when_one_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert host_address.gloo_address() == "interface eth7"


def test_gloo_address_is_loopback_when_the_name_does_not_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(host_address.socket, "gethostname", lambda: "no-such-host.invalid")
    assert host_address.gloo_address() == "127.0.0.1"
