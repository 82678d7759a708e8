"""Pieces the engine benchmarks share: the app they start and vLLM's direct P/D flow."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from engines.base import GenerateRequest
from engines.kv_params import KVTransferParams


@contextmanager
def embedded_app(
    kv: dict[str, Any] | None = None, *, serve_in_loop: bool = False
) -> Iterator[tuple[str, str, Any, Any]]:
    """Start the embedded default (with ``kv`` as its ``kv`` section, and
    ``ray.serve_in_loop``) on a free port; yield (base URL, model name, prefill handle,
    decode handle) — the handles stream, for driving the engines directly."""
    from ray import serve

    from orchestrator import runtime
    from orchestrator.config import parse_config
    from orchestrator.serve.engine_host import free_port

    tmp = Path(tempfile.mkdtemp(prefix="kvt-bench-"))
    config = parse_config(
        {
            "server": {"port": free_port()},
            "ray": {
                "temp_dir": str(tmp / "ray"),
                "serve_in_loop": serve_in_loop,
            },
            "kv": kv or {},
        }
    )
    with runtime.running(config) as base_url:
        handles = [
            serve.get_deployment_handle(f"{pool}-pool", app_name="kvtide").options(stream=True)
            for pool in ("prefill", "decode")
        ]
        yield base_url, config.model.name, handles[0], handles[1]


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


@dataclass
class DirectTurn:
    """One request through vLLM's own P/D flow, timed at the caller."""

    ttft_s: float
    prefill_s: float = 0.0  # the prefill request, from its call to its last chunk
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    kept: KVTransferParams | None = None  # decode's final params: its kept blocks


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
    turn = DirectTurn(ttft_s=0.0, prefill_s=time.monotonic() - t0)
    async for chunk in decode.generate.remote(
        GenerateRequest(
            request_id=rid + "-d",
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            ignore_eos=True,
            kv_transfer_params=pre.kv_transfer_params,
        )
    ):
        if chunk.token_ids:
            turn.token_times.append(time.monotonic())
            turn.token_ids.extend(chunk.token_ids)
        turn.kept = chunk.kv_transfer_params or turn.kept
    assert turn.token_times, "the decode engine produced no tokens"
    turn.ttft_s = turn.token_times[0] - t0
    return turn


@dataclass
class StreamedTurn:
    """One streamed completion through kvtide's HTTP API, timed at the client."""

    t_start: float
    token_times: list[float] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)  # the response's `kvtide` object

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.t_start


async def stream_completion(
    client: Any, model: str, prompt: list[int], max_tokens: int, session: str | None = None
) -> StreamedTurn:
    """POST a streamed greedy completion (``ignore_eos``) and time every text chunk."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"x-session-id": session} if session else {}
    turn = StreamedTurn(t_start=time.monotonic())
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if any(c.get("text") for c in event.get("choices", [])):
                turn.token_times.append(time.monotonic())
            turn.report = event.get("kvtide") or turn.report
    assert turn.token_times, "the endpoint streamed no text"
    return turn
