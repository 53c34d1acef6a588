"""Where a process of the run is reached: free ports and the addresses it advertises.

One machine: loopback. A job across nodes: this node's host name, which the launcher sets
(``REALSCALE_ADVERTISE_HOST``) so that servers and trainer ranks on other nodes reach it.
"""

from __future__ import annotations

import os
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it); ``""`` asks for
    one free on every interface of this node, where ranks on other nodes reach it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def advertise_host() -> str:
    """The address rank 0 offers to generation servers for the weight-update group:
    loopback on one machine, this node's host name when the job spans nodes."""
    return os.environ.get("REALSCALE_ADVERTISE_HOST", "127.0.0.1")


def advertised_host(bind_host: str) -> str:
    """The address other nodes reach a socket bound to ``bind_host`` on."""
    if bind_host in ("0.0.0.0", "", "::"):
        return socket.gethostname()
    return bind_host
