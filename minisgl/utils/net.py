"""A free TCP port for a server another process connects to while it may not be bound yet."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10000  # below: the well-known and registered services people run


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(span: int = 1) -> int:
    """A port on loopback that was free a moment ago, with the `span - 1` after it free as well.

    Drawn below the kernel's ephemeral range. A client that polls a port in that range before its server
    has bound it can be handed that very port as its own source and connect to itself; it then reads its
    own request back, and holds the port the server is about to bind. No source port is ever drawn below
    the range."""
    top = min(_ephemeral_low(), 65536) - span
    if top <= _LOWEST:  # an unusual range: take whatever the kernel gives
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random()  # its own: a seeded global generator would give parallel runs the same ports
    for _ in range(200):
        port = rng.randrange(_LOWEST, top)
        try:
            for p in range(port, port + span):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no {span} free TCP ports in a row between {_LOWEST} and {top + span}")
