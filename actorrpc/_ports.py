"""Free TCP ports for a rendezvous store, chosen below the kernel's ephemeral range.

A client that keeps connecting to a port nobody listens on yet (a worker waiting
for the store to come up) may be given that very port as its own ephemeral port:
a TCP self-connect, which then holds the port, and the store fails to listen
(``EADDRINUSE``). Ports below the ephemeral range are never handed out that way.
"""

from __future__ import annotations

import contextlib
import random
import socket

__all__ = ["free_ports"]

_LOWEST = 10000
_ATTEMPTS = 200
_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_start() -> int:
    try:
        with open(_RANGE_FILE, encoding="ascii") as file:
            return int(file.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(addr: str, count: int) -> list[int]:
    """``count`` distinct TCP ports free on ``addr`` now, below the ephemeral range if possible."""
    start = _ephemeral_start()
    ports: list[int] = []
    with contextlib.ExitStack() as stack:  # held until all are chosen: they stay distinct
        for _ in range(_ATTEMPTS if start - _LOWEST > 1000 else 0):
            if len(ports) == count:
                break
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            port = random.randrange(_LOWEST, start)
            try:
                sock.bind((addr, port))
            except OSError:
                continue  # taken (or not bindable): try another
            ports.append(port)
        while len(ports) < count:  # an unusual range: let the kernel choose
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((addr, 0))
            ports.append(int(sock.getsockname()[1]))
    return ports
