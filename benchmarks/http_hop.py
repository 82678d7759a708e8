"""Where the HTTP hop in front of kvtide's ingress spends its milliseconds.

A client reaches an ingress replica through Serve's HAProxy (``kvtide up``'s default:
direct ingress, the replica's own uvicorn behind the proxy). The same requests go to
the proxy and straight to the replica's own port in the same run, so each difference
is the proxy's share; the replica's own share is measured with a route that does no
work (``GET /v1/models``):

* ``models`` — ``GET /v1/models`` on a kept-alive connection: proxy + uvicorn +
  FastAPI routing, no turn;
* ``models, new conn`` — the same with a new TCP connection each time;
* ``body 4k`` — ``POST /v1/completions`` with a 4,096-token prompt as token ids (~20 KB
  of JSON) and ``max_tokens`` 1, unstreamed: the body through the proxy, parsed, and a
  one-token turn (the engines' time is the same on both routes);
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
from pathlib import Path

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


def ms(values: list[float], q: float = 0.5) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


async def timed_gets(base: str, n: int, *, new_conn: bool) -> list[float]:
    out: list[float] = []
    async with httpx.AsyncClient(base_url=base, timeout=30) as kept:
        for _ in range(n):
            t0 = time.monotonic()
            if new_conn:
                async with httpx.AsyncClient(base_url=base, timeout=30) as fresh:
                    (await fresh.get("/v1/models")).raise_for_status()
            else:
                (await kept.get("/v1/models")).raise_for_status()
            out.append(time.monotonic() - t0)
    return out


async def timed_bodies(base: str, model: str, n: int, rng: random.Random) -> list[float]:
    out: list[float] = []
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        for _ in range(n):
            prompt = [rng.randrange(100, 1000) for _ in range(4096)]
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            t0 = time.monotonic()
            (await client.post("/v1/completions", json=body)).raise_for_status()
            out.append(time.monotonic() - t0)
    return out


async def timed_streams(
    base: str, model: str, n: int, rng: random.Random
) -> tuple[list[float], list[float]]:
    ttfts: list[float] = []
    gaps: list[float] = []
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        for _ in range(n):
            prompt = [rng.randrange(100, 1000) for _ in range(256)]
            turn = await stream_completion(client, model, prompt, 64)
            ttfts.append(turn.ttft_s)
            gaps.extend(token_gaps(turn.token_times, turn.token_counts))
    return ttfts, gaps


async def measure(base: str, replica: str, model: str, n: int) -> list[list[str]]:
    rows: list[list[str]] = []

    def row(name: str, front: float, own: float) -> None:
        rows.append([name, f"{front:.2f}", f"{own:.2f}", f"{front - own:+.2f}"])

    for new_conn in (False, True):
        front = await timed_gets(base, n, new_conn=new_conn)
        own = await timed_gets(replica, n, new_conn=new_conn)
        row("models, new conn" if new_conn else "models", ms(front), ms(own))
    # The same prompts on both routes (fresh ones each request: no prefix cache hits).
    front_b = await timed_bodies(base, model, n // 4, random.Random(1))
    own_b = await timed_bodies(replica, model, n // 4, random.Random(2))
    row("body 4k (1 token)", ms(front_b), ms(own_b))
    f_ttft, f_gaps = await timed_streams(base, model, n // 4, random.Random(3))
    o_ttft, o_gaps = await timed_streams(replica, model, n // 4, random.Random(4))
    row("stream: TTFT", ms(f_ttft), ms(o_ttft))
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
        f"the replica = its own uvicorn port. {args.requests} requests a row "
        "(a quarter for the turns); one run, this machine."
    )


if __name__ == "__main__":
    main()
