"""Addresses and interfaces of this node (realscale.parallel.net): the route to a peer
picks the address, the address names the interface; nothing is guessed."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from realscale.parallel.net import interface_of, node_address


def test_loopback_and_unknown_addresses() -> None:
    assert node_address("127.0.0.1") == "127.0.0.1" and node_address("localhost") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: on no interface of this machine


@pytest.mark.skipif(shutil.which("ip") is None, reason="no iproute2 'ip' to cross-check with")
def test_every_interface_address_names_its_interface() -> None:
    rows = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout.splitlines()
    pairs = [(r.split()[1], r.split()[3].split("/")[0]) for r in rows]
    assert pairs
    for name, addr in pairs:
        assert interface_of(addr) == name, (name, addr)
        assert node_address(addr) == addr  # this node reaches its own address from that address
