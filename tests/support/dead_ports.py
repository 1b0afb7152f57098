"""Loopback ports nobody answers on, held for as long as a test needs them.

A port bound and closed again (how the tests found a "dead" target before) is free at
once: the test command runs its groups side by side, and their NIXL agents (UCX
listeners), vLLM side channels and kvcached-pd listeners take ports from the same
kernel range, so another process can bind it before the test connects and then answer
the target that was meant to be dead (one fresh-clone run, 2026-11-28, vLLM 0.26.0
"rest": a claim to such a port ended in something other than the time-out the test
expected). A socket bound and never listening keeps the port: a connection to it is
refused, as to a closed port, nothing answers, and no other process can bind it until
the test lets it go.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Iterator


@contextlib.contextmanager
def dead_ports(count: int = 1) -> Iterator[list[int]]:
    """``count`` loopback ports that refuse every connection until the block ends."""
    held: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket()
            held.append(sock)
            sock.bind(("127.0.0.1", 0))
        yield [sock.getsockname()[1] for sock in held]
    finally:
        for sock in held:
            sock.close()
