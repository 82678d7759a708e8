"""A decode engine's warm-up turn, run before it takes traffic.

vLLM's NixlConnector meets a peer engine lazily: the first request that reads another
engine's KV pays the NIXL handshake (metadata exchange, memory registration), and each
engine's first request pays its own start-up work. On a busy host the handshake can
miss vLLM's fixed 5 s receive timeout: the first user's pull then fails and that turn is
recomputed. So a new decode engine first runs one throw-away turn with each prefill
deployment, in both directions:

1. prefill the warm-up prompt, keeping its KV for a decode (``keep_for_decode``);
2. decode it here, pulling the prefill's KV (the decode → prefill handshake) and keeping
   the finished turn's blocks as for a session's send-back;
3. read those blocks back into the prefill engine (the prefill → decode handshake),
   which frees them here; the prefill keeps no copy of them (``pull_back(keep=False)``).

With the KV integrity check on (``kv.integrity_sample_fraction`` above 0) a fourth,
sessionless request asks the prefill engine for the warm-up prompt's log probabilities:
vLLM's first such request on an engine costs seconds on CPU (about 2 s, once; later ones
about 1.3x a plain prefill), which would otherwise land beside the first checked turn's
neighbours. Its failure is logged and changes nothing else.

A decode engine that may extend turns in place (``kv.extend``) also measures its own
prefill time per token there (``measure_prefill``), which its host reports with its
load: the cost function prices an in-place prefill with it (``policies.kv_cost``).

A step that fails is tried again (``attempts`` requests in all after the first
prefill, each bounded by ``step_timeout_s``): a failed turn with a new turn, a failed
read-back on the same kept blocks. Nothing is booked with the KV service and no blocks stay
pinned (the read-back frees them; if it never succeeds they expire at the decode TTL).
The warm-up never stops an engine from serving: its outcome is returned and logged.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engines.base import GenerateChunk, GenerateRequest, Sampling, final_chunk
from engines.kv_params import KVTransferParams

__all__ = ["WarmUp", "measure_prefill", "warm_up_prompt_tokens", "warm_up_transfers"]

log = logging.getLogger(__name__)

Generate = Callable[[GenerateRequest], AsyncIterator[GenerateChunk]]


@dataclass(frozen=True, slots=True)
class WarmUp:
    """How a warm-up went: ``sent_back`` once a whole turn and its read-back succeeded."""

    sent_back: bool
    attempts: int
    seconds: float
    error: str | None = None


async def _last(stream: AsyncIterator[GenerateChunk], timeout_s: float) -> GenerateChunk:
    return await asyncio.wait_for(final_chunk(stream), timeout_s)


def warm_up_prompt_tokens(block_size: int, recompute_threshold_tokens: int) -> int:
    """A warm-up prompt long enough that both of its transfers are reads: past the
    recompute threshold by two blocks (a decode's read-back covers prompt + output)."""
    return max(4 * block_size, recompute_threshold_tokens + 2 * block_size)


async def warm_up_transfers(
    decode: Generate,
    prefill: Generate,
    *,
    name: str,
    num_prompt_tokens: int,
    vocab_size: int,
    step_timeout_s: float,
    attempts: int = 3,
    clock: Callable[[], float] = time.monotonic,
    prompt_logprobs: bool = False,
) -> WarmUp:
    """One turn between this decode engine (``decode``) and a prefill pool
    (``prefill``), then its read-back; see the module docstring. The prompt must be
    longer than the engines' ``kv_recompute_threshold`` (``warm_up_prompt_tokens``), or
    vLLM recomputes instead of reading and no handshake is made. Its token ids are drawn
    from the upper half of the model's vocabulary (``vocab_size``): vLLM rejects an id
    past it, and a random run there is one no user prompt is likely to share (it stays in
    the prefill engine's prefix cache like any prompt). ``prompt_logprobs``: also warm the
    prefill's prompt log probabilities (the integrity check's request)."""
    if prompt_logprobs:
        await _warm_prompt_logprobs(prefill, name, vocab_size, step_timeout_s)
    rng = random.Random(name)
    prompt = [rng.randrange(vocab_size // 2, vocab_size) for _ in range(num_prompt_tokens)]
    started = clock()
    error: str | None = None
    # The turn's decode output and the blocks decode kept, once the turn has run: a
    # failed read-back is tried again on the same blocks (so they are freed).
    done: tuple[list[int], KVTransferParams] | None = None
    for attempt in range(1, attempts + 1):
        rid = f"warmup-{name}-{attempt}"
        try:
            if done is None:
                out, kept = await _turn(decode, prefill, rid, prompt, step_timeout_s)
                if kept is None or kept.kept_blocks() is None:
                    # Decode keeps nothing (send-back is off): the one direction is warm.
                    return WarmUp(True, attempt, clock() - started)
                done = (out, kept)
            await _last(
                prefill(
                    GenerateRequest(
                        request_id=f"{rid}-r",
                        prompt_token_ids=[*prompt, *done[0]],
                        max_tokens=1,
                        kv_transfer_params=done[1].pull_back(keep=False),
                    )
                ),
                step_timeout_s,
            )
            return WarmUp(True, attempt, clock() - started)
        except Exception as exc:  # a warm-up failure must never stop the engine
            error = f"{type(exc).__name__}: {exc}"
            log.warning("warm-up of %s, attempt %d: %s", name, attempt, error)
    return WarmUp(False, attempts, clock() - started, error)


async def _warm_prompt_logprobs(
    prefill: Generate, name: str, vocab_size: int, timeout_s: float
) -> None:
    """One sessionless prefill with prompt log probabilities (no KV kept or read)."""
    rng = random.Random(f"{name}-i")
    request = GenerateRequest(
        request_id=f"warmup-{name}-i",
        prompt_token_ids=[rng.randrange(vocab_size // 2, vocab_size) for _ in range(16)],
        max_tokens=1,
        prompt_logprobs=0,
    )
    try:
        await _last(prefill(request), timeout_s)
    except Exception as exc:  # a warm-up failure must never stop the engine
        log.warning(
            "warm-up of %s: prompt log probabilities: %s: %s", name, type(exc).__name__, exc
        )


async def _turn(
    decode: Generate, prefill: Generate, rid: str, prompt: list[int], timeout_s: float
) -> tuple[list[int], KVTransferParams | None]:
    """Prefill ``prompt`` for a decode, decode it here: the tokens made and the final
    params (the blocks decode kept)."""
    pre = await _last(
        prefill(
            GenerateRequest(
                request_id=f"{rid}-p",
                prompt_token_ids=prompt,
                max_tokens=1,
                kv_transfer_params=KVTransferParams.keep_for_decode(),
            )
        ),
        timeout_s,
    )
    if pre.kv_transfer_params is None:
        raise RuntimeError("the prefill engine returned no kv_transfer_params")
    out: list[int] = []

    async def tokens() -> AsyncIterator[GenerateChunk]:
        async for chunk in decode(
            GenerateRequest(
                request_id=f"{rid}-d",
                prompt_token_ids=prompt,
                max_tokens=2,
                sampling=Sampling(ignore_eos=True),
                # Kept, for the read-back that makes the other handshake.
                kv_transfer_params=pre.kv_transfer_params.for_decode(keep=True),
            )
        ):
            out.extend(chunk.token_ids)
            yield chunk

    last = await _last(tokens(), timeout_s)
    return out, last.kv_transfer_params


async def measure_prefill(
    decode: Generate,
    *,
    name: str,
    num_prompt_tokens: int,
    vocab_size: int,
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> float | None:
    """This decode engine's prefill time per token: a prompt of ``num_prompt_tokens``
    and one of a quarter as many, each computed here from scratch (tokens of the upper
    half of the vocabulary no request sent before, so no prefix cache hit; nothing
    kept) with one output token, timed one after the other; the difference in seconds
    over the difference in tokens, so that what a request costs whatever its length
    (admission, its decode step, the stream) cancels. None when a request failed or the
    longer was not the slower (the figure would mean nothing)."""
    short = max(1, num_prompt_tokens // 4)
    if num_prompt_tokens <= short:
        return None
    seconds: list[float] = []
    for n in (short, num_prompt_tokens):
        rng = random.Random(f"{name}-prefill-{n}")
        request = GenerateRequest(
            request_id=f"warmup-{name}-prefill-{n}",
            prompt_token_ids=[rng.randrange(vocab_size // 2, vocab_size) for _ in range(n)],
            max_tokens=1,
            kv_transfer_params=KVTransferParams(kvtide_keep=False),
        )
        started = clock()
        try:
            await _last(decode(request), timeout_s)
        except Exception as exc:  # a measurement's failure must never stop the engine
            log.warning("prefill measurement of %s: %s: %s", name, type(exc).__name__, exc)
            return None
        seconds.append(clock() - started)
    extra_s = seconds[1] - seconds[0]
    return extra_s / (num_prompt_tokens - short) if extra_s > 0 else None
