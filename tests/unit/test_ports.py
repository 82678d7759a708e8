"""Listener ports come from outside the range outgoing connections draw from, so that a
port chosen now is still free when HAProxy or an engine binds it seconds later."""

from __future__ import annotations

import socket

from orchestrator.cluster import ports
from orchestrator.cluster.ports import LISTEN_RANGE_START, LISTEN_RANGE_STOP, free_port


def _ephemeral_range() -> tuple[int, int]:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = f.read().split()
    return int(low), int(high)


def test_a_listener_port_is_below_the_ephemeral_range_and_bindable() -> None:
    low, _ = _ephemeral_range()
    for host in ("127.0.0.1", "0.0.0.0"):
        for _ in range(20):
            port = free_port(host)
            assert LISTEN_RANGE_START <= port < min(low, LISTEN_RANGE_STOP)
            with socket.socket() as s:
                s.bind((host, port))


def test_outgoing_connections_never_take_a_listener_port() -> None:
    """What the choice guards against: every source port of an outgoing connection is in
    the ephemeral range, where a port from ``free_port`` never is."""
    low, high = _ephemeral_range()
    with socket.socket() as server:
        server.bind(("127.0.0.1", free_port()))
        server.listen(64)
        clients = [socket.create_connection(server.getsockname()) for _ in range(32)]
        try:
            for c in clients:
                assert low <= c.getsockname()[1] <= high
        finally:
            for c in clients:
                c.close()


def test_a_taken_port_is_never_returned(monkeypatch) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", free_port()))
    taken.listen(1)
    port = taken.getsockname()[1]
    tries = iter([port, port, port + 1 if port + 1 < LISTEN_RANGE_STOP else port - 1])

    class Pick:
        def randrange(self, start: int, stop: int) -> int:
            return next(tries)

    monkeypatch.setattr(ports.random, "SystemRandom", lambda: Pick())
    try:
        got = free_port()
        assert got != port
        assert abs(got - port) == 1
    finally:
        taken.close()


def test_a_port_promised_to_another_listener_is_never_returned(monkeypatch) -> None:
    # The server's port is chosen before Ray starts and bound only when Serve starts its
    # HAProxy: free now, so only ``avoid`` keeps HAProxy's stats port off it.
    promised = free_port()
    other = promised + 1 if promised + 1 < LISTEN_RANGE_STOP else promised - 1
    tries = iter([promised, promised, other])

    class Pick:
        def randrange(self, start: int, stop: int) -> int:
            return next(tries)

    monkeypatch.setattr(ports.random, "SystemRandom", lambda: Pick())
    assert free_port("0.0.0.0", avoid={promised}) == other


def test_haproxys_admin_ports_are_not_the_servers_port(monkeypatch) -> None:
    from orchestrator.config import parse_config
    from orchestrator.runtime import local_ray_env

    config = parse_config({"ray": {"direct_ingress": True}})
    server = config.server.port
    picks = iter([server, server + 1, server + 1, server + 2])

    class Pick:
        def randrange(self, start: int, stop: int) -> int:
            return next(picks)

    monkeypatch.setattr(ports, "_bindable", lambda host, port: True)
    monkeypatch.setattr(ports.random, "SystemRandom", lambda: Pick())
    env = local_ray_env(config)
    stats, metrics = (
        int(env["RAY_SERVE_HAPROXY_STATS_PORT"]),
        int(env["RAY_SERVE_HAPROXY_METRICS_PORT"]),
    )
    assert (stats, metrics) == (server + 1, server + 2)
