"""Where the HTTP hop in front of kvtide's ingress spends its milliseconds.

A client reaches an ingress replica through Serve's HAProxy (``kvtide up``'s default:
direct ingress, the replica's own uvicorn behind the proxy). The same requests go to
the proxy and straight to the replica's own port in the same run, so each difference
is the proxy's share; the replica's own share is measured with a route that does no
work (``GET /v1/models``):

* ``models`` — ``GET /v1/models`` on a kept-alive connection: proxy + uvicorn +
  FastAPI routing, no turn;
* ``models, new conn`` — the same with a new TCP connection each time (``Connection:
  close``);
* ``body 4k tokens, refused`` — ``POST /v1/completions`` of a 4,096-token prompt as
  token ids (~20 KB of JSON) naming an unknown model: the body through the proxy and
  parsed, then a 404, no turn;
* ``turn, 1 token, unstreamed`` — a one-token completion of a fresh 64-token prompt;
* ``stream`` — a streamed 64-token completion: time to the first token and the gaps
  between events (the proxy forwarding each SSE event as it comes, or holding it).

    python benchmarks/http_hop.py [--requests 40]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from benchmarks.common import embedded_app, stream_completion, token_gaps
from orchestrator.cli.table import format_table

REPLICA_PORTS = range(30000, 31001)  # Serve's direct-ingress replica ports


def replica_url() -> str:
    """The ingress replica's own HTTP address (its listener in Serve's direct-ingress
    range; one ingress replica in the embedded default)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                port = int(local.rsplit(":", 1)[1], 16)
                if state == "0A" and port in REPLICA_PORTS:  # 0A: LISTEN
                    ports.add(port)
    if len(ports) != 1:
        raise SystemExit(f"expected one ingress replica listener, found ports {sorted(ports)}")
    return f"http://127.0.0.1:{min(ports)}"


def firsts(results: list[list[float]]) -> list[float]:
    return [r[0] for r in results]


def ms(values: list[float], q: float = 0.5) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


Probe = Callable[[httpx.AsyncClient], Awaitable[list[float]]]


async def paired(
    base: str, replica: str, n: int, probe: Probe
) -> tuple[list[list[float]], list[list[float]]]:
    """``probe`` ``n`` times on each route, the routes alternating (one kept-alive
    client each), so that both see the same machine: what each call returned, by
    route."""
    front: list[list[float]] = []
    own: list[list[float]] = []
    async with (
        httpx.AsyncClient(base_url=base, timeout=60) as via,
        httpx.AsyncClient(base_url=replica, timeout=60) as direct,
    ):
        for _ in range(n):
            front.append(await probe(via))
            own.append(await probe(direct))
    return front, own


def get_models(close: bool) -> Probe:
    """``GET /v1/models``, on a kept-alive connection or a new one each time (the
    server closes it after each answer: ``Connection: close``)."""
    headers = {"connection": "close"} if close else {}

    async def probe(client: httpx.AsyncClient) -> list[float]:
        t0 = time.monotonic()
        (await client.get("/v1/models", headers=headers)).raise_for_status()
        return [time.monotonic() - t0]

    return probe


def post(body: dict[str, Any], status: int, prompt_tokens: int, rng: random.Random) -> Probe:
    """``POST /v1/completions`` of ``body`` with a fresh prompt each time (no prefix
    cache hits), answered with ``status``."""

    async def probe(client: httpx.AsyncClient) -> list[float]:
        prompt = [rng.randrange(100, 1000) for _ in range(prompt_tokens)]
        t0 = time.monotonic()
        resp = await client.post("/v1/completions", json={**body, "prompt": prompt})
        elapsed = time.monotonic() - t0
        assert resp.status_code == status, resp.text[:300]
        return [elapsed]

    return probe


def stream(model: str, rng: random.Random) -> Probe:
    """A streamed 64-token completion of a fresh 64-token prompt: its TTFT, then the
    gaps between its events."""

    async def probe(client: httpx.AsyncClient) -> list[float]:
        prompt = [rng.randrange(100, 1000) for _ in range(64)]
        turn = await stream_completion(client, model, prompt, 64)
        return [turn.ttft_s, *token_gaps(turn.token_times, turn.token_counts)]

    return probe


async def measure(base: str, replica: str, model: str, n: int) -> list[list[str]]:
    rows: list[list[str]] = []

    def row(name: str, front: float, own: float) -> None:
        rows.append([name, f"{front:.2f}", f"{own:.2f}", f"{front - own:+.2f}"])

    for close in (False, True):
        front, own = await paired(base, replica, n, get_models(close))
        row("models, new conn" if close else "models", ms(firsts(front)), ms(firsts(own)))
    rng = random.Random(1)
    # ~20 KB of JSON read and parsed, refused before any turn (an unknown model: 404).
    refused = {"model": "no-such-model", "max_tokens": 1}
    front, own = await paired(base, replica, n, post(refused, 404, 4096, rng))
    row("body 4k tokens, refused", ms(firsts(front)), ms(firsts(own)))
    turn = {"model": model, "max_tokens": 1, "temperature": 0}
    front, own = await paired(base, replica, n, post(turn, 200, 64, rng))
    row("turn, 1 token, unstreamed", ms(firsts(front)), ms(firsts(own)))
    # Each stream's TTFT, then its gaps.
    front, own = await paired(base, replica, n // 2, stream(model, rng))
    row("stream: TTFT", ms(firsts(front)), ms(firsts(own)))
    f_gaps = [g for s in front for g in s[1:]]
    o_gaps = [g for s in own for g in s[1:]]
    row("stream: gap p50", ms(f_gaps), ms(o_gaps))
    row("stream: gap p99", ms(f_gaps, 0.99), ms(o_gaps, 0.99))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()
    with embedded_app() as (base, model, _prefill, _decode):
        replica = replica_url()
        rows = asyncio.run(measure(base, replica, model, args.requests))
    print(
        format_table(
            ["request (p50 unless said)", "via HAProxy ms", "to the replica ms", "proxy ms"],
            rows,
        )
    )
    print(
        "HAProxy = Serve's proxy in front of the ingress replica (kvtide up's default); "
        f"the replica = its own uvicorn port. {args.requests} requests a row on each "
        "route, the routes alternating (half as many streams); one run, this machine."
    )


if __name__ == "__main__":
    main()
