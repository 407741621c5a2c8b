"""A free TCP port on loopback, for the servers tests start (every network test talks to 127.0.0.1 only)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
