"""Ports for the listeners kvtide starts (HTTP front, HAProxy's stats and metrics, an
engine's NIXL side channel and KV-event socket).

A port the kernel hands out for ``bind(0)`` comes from the ephemeral range
(``net.ipv4.ip_local_port_range``, 32768-60999 by default), the same range every outgoing
connection on the machine draws its source port from. Between choosing such a port and
the listener binding it (seconds later, in another process: Ray starts HAProxy only when
Serve starts) a connection of Ray's own can take it, and the listener fails with
``Address already in use``. The ports here come from 20000-29999: below the ephemeral
range, where only explicit binds land, above Ray's default worker ports (10002-19999)
and below the ports Serve gives direct-ingress replicas (30000-31000).
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection

__all__ = ["LISTEN_RANGE_START", "LISTEN_RANGE_STOP", "free_port"]

LISTEN_RANGE_START = 20000
"""The first port tried: above Ray's default worker ports (``--min/max-worker-port``)."""
LISTEN_RANGE_STOP = 30000
"""Past the last port tried: Serve's direct-ingress replicas take 30000-31000
(``RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT``)."""

_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_start() -> int:
    try:
        with open(_EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A TCP port free now on ``host`` for a listener that binds it moments later, chosen
    at random below the ephemeral range (see the module doc); the kernel's choice when
    that range is full or the machine has moved its ephemeral range down. Never one of
    ``avoid``: ports already promised to listeners that have not bound them yet (free
    now, so the bind test alone would hand them out again)."""
    stop = min(LISTEN_RANGE_STOP, _ephemeral_start())
    if stop - LISTEN_RANGE_START >= 1000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(LISTEN_RANGE_START, stop)
            if port not in avoid and _bindable(host, port):
                return port
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port
