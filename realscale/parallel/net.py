"""Where a process of the run is reached: free ports and the addresses it advertises.

One machine: loopback. A job across nodes: this node's address on the network that leads
to the other nodes (:func:`node_address`), which the launcher sets
(``REALSCALE_ADVERTISE_HOST``) so that servers and trainer ranks on other nodes reach it,
and the interface that holds it (:func:`interface_of`: ``GLOO_SOCKET_IFNAME``). An
address, not a host name: a node's name may resolve to loopback on the node itself
(Debian's ``127.0.1.1 <host>``), and a Slurm node name need not resolve at all
(``NodeName`` vs ``NodeAddr``).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct


def free_port(host: str = "127.0.0.1", avoid: int = 0) -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it); ``""`` asks for
    one free on every interface of this node, where ranks on other nodes reach it. Never
    ``avoid`` (a restarted server's predecessor's: clients tell servers apart by URL)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port != avoid:
            return port


def advertise_host() -> str:
    """The address rank 0 offers to generation servers for the weight-update group:
    loopback on one machine, this node's host name when the job spans nodes."""
    return os.environ.get("REALSCALE_ADVERTISE_HOST", "127.0.0.1")


def advertised_host(bind_host: str) -> str:
    """The address other nodes reach a socket bound to ``bind_host`` on: for a wildcard,
    this node's advertised address where the launcher set one, else its host name."""
    if bind_host in ("0.0.0.0", "", "::"):
        return os.environ.get("REALSCALE_ADVERTISE_HOST") or socket.gethostname()
    return bind_host


def node_address(peer: str) -> str:
    """The IPv4 address this node sends from to reach ``peer`` (a host name or address of
    another node of the job: the routing table picks the interface; nothing is sent)."""
    addr = socket.gethostbyname(peer)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((addr, 9))  # UDP connect: a route lookup, no packet
        return str(sock.getsockname()[0])


_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_of(address: str) -> str | None:
    """The name of this node's interface that holds the IPv4 ``address`` (``rs0``,
    ``eth0``, ``ib0`` ...; never guessed), or None when no interface has it."""
    if address.startswith("127."):
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None
