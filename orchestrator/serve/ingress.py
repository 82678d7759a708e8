"""The OpenAI-compatible ingress: a Ray Serve deployment with a FastAPI app.

It validates and tokenizes requests (so the router sees token ids and the KV planner can
hash prefixes), runs each turn through the ``Router`` (prefill pool → NIXL → decode pool)
and streams SSE back. Errors are OpenAI-style bodies with 4xx/5xx codes; a failed request
leaves no KV record behind.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``GET /kvtide/stats`` (KV lifecycle counters and engine counters).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from engines.base import GenerateChunk, GenerateRequest
from orchestrator.config import KVTideConfig
from orchestrator.errors import ContextLengthExceeded, EngineUnavailable, RequestError
from orchestrator.kv_planner import KVPlanner, kv_lifecycle_config
from orchestrator.model_info import kv_bytes_per_token_of
from orchestrator.router import Router, TurnReport
from orchestrator.serve import openai_api as api
from orchestrator.session_tokens import SessionTokens

__all__ = ["HandlePool", "Ingress", "fastapi_app"]

log = logging.getLogger("kvtide.ingress")
fastapi_app = FastAPI(title="kvtide", docs_url=None, redoc_url=None)


@fastapi_app.exception_handler(RequestError)
async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code)


@fastapi_app.exception_handler(Exception)
async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error")
    body = {
        "error": {
            "message": f"internal error: {type(exc).__name__}: {exc}",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }
    return JSONResponse(body, status_code=500)


def _usage(report: TurnReport) -> dict[str, Any]:
    return api.usage(
        report.num_prompt_tokens, report.num_completion_tokens, report.num_cached_tokens
    )


class _Output:
    """A turn's generated text and token ids, gathered from its chunks."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []

    def add(self, chunk: GenerateChunk) -> None:
        self.text.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)


class HandlePool:
    """A pool reached through its Serve deployment handle (streaming ``generate``)."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle
        self._stream = handle.options(stream=True)

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        stream: AsyncIterator[GenerateChunk] = self._stream.generate.remote(request)
        return stream


@serve.deployment(name="ingress", max_ongoing_requests=256)
@serve.ingress(fastapi_app)
class Ingress:
    async def __init__(
        self, config: KVTideConfig, prefill: DeploymentHandle, decode: DeploymentHandle
    ) -> None:
        from transformers import AutoTokenizer  # heavy; only in the ingress replica

        self.config = config
        self.model_path = config.model.resolved_path()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.prefill_handle, self.decode_handle = prefill, decode
        info = await decode.info.remote()
        kv = config.kv
        self.planner = KVPlanner(
            kv_lifecycle_config(
                ttl_s=kv.decoder_kv_blocks_ttl_s,
                safety_margin_s=kv.safety_margin_s,
                recompute_threshold_tokens=kv.kv_recompute_threshold_tokens,
                kv_bytes_per_token=kv_bytes_per_token_of(self.model_path, config.model.dtype),
                block_size_tokens=info.block_size,
                idle_budget_bytes_per_engine=(
                    None
                    if kv.idle_budget_mib_per_engine is None
                    else int(kv.idle_budget_mib_per_engine * 2**20)
                ),
            )
        )
        self.session_tokens = SessionTokens(ttl_s=kv.decoder_kv_blocks_ttl_s)
        self.router = Router(
            prefill=HandlePool(prefill),
            decode=HandlePool(decode),
            planner=self.planner,
            pull_timeout_s=kv.pull_timeout_s,
            tokens_of=self.session_tokens.token_ids,
        )
        self._ticker = asyncio.get_running_loop().create_task(self._tick_forever())
        # Session books live long: keep the collector from rescanning start-up objects
        # (a full pass over large books stalls the event loop for tenths of a second).
        gc.collect()
        gc.freeze()

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.router.apply(self.planner.tick(time.monotonic()))

    # ---- routes ----------------------------------------------------------------------

    @fastapi_app.get("/health")
    async def health(self) -> JSONResponse:
        try:
            await asyncio.wait_for(
                asyncio.gather(self.prefill_handle.info.remote(), self.decode_handle.info.remote()),
                timeout=10,
            )
        except Exception as exc:
            raise EngineUnavailable(f"engines not ready: {type(exc).__name__}: {exc}") from exc
        return JSONResponse({"status": "ok"})

    @fastapi_app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.config.model.name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "kvtide",
                    "max_model_len": self.config.model.max_model_len,
                }
            ],
        }

    @fastapi_app.get("/kvtide/stats")
    async def stats(self) -> dict[str, Any]:
        pre, dec = await asyncio.gather(
            self.prefill_handle.stats.remote(), self.decode_handle.stats.remote()
        )
        import msgspec

        router = self.router
        return {
            "kv": {
                **self.planner.stats(),
                "bytes_held": {e: self.planner.lifecycle.bytes_held(e) for e in self._engines()},
                "num_drains": router.num_drains,
                "num_drain_failures": router.num_drain_failures,
                "num_undrainable": router.num_undrainable,
            },
            "engines": {"prefill": msgspec.to_builtins(pre), "decode": msgspec.to_builtins(dec)},
        }

    def _engines(self) -> list[str]:
        return sorted({r.engine_id for r in self.planner.lifecycle.records()})

    @fastapi_app.get("/kvtide/sessions/{session_id}")
    async def get_session(self, session_id: str) -> dict[str, Any]:
        """Where kvtide holds the session's KV now (``record`` is null when nothing is
        offered: never recorded, expired, evicted or closed)."""
        sid = api.parse_session_id(session_id)
        assert sid is not None
        rec = self.planner.lifecycle.record(sid)
        record = None
        if rec is not None:
            record = {
                "engine_id": rec.engine_id,
                "num_tokens": rec.num_tokens,
                "bytes_held": rec.bytes_held,
                "expires_in_s": round(rec.expiry_s - time.monotonic(), 3),
            }
        return {"id": sid, "object": "session", "record": record}

    @fastapi_app.delete("/kvtide/sessions/{session_id}")
    async def close_session(self, session_id: str) -> dict[str, Any]:
        """End a session: its kept KV is drained back to prefill (freed on decode now)."""
        sid = api.parse_session_id(session_id)
        assert sid is not None
        self.router.apply(self.planner.close(sid, time.monotonic()))
        self.session_tokens.forget(sid)
        return {"id": sid, "object": "session.deleted", "deleted": True}

    @fastapi_app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Any:
        body = api.parse_body(await request.body(), request.headers.get("content-type"))
        req = api.parse_chat(body, self.config.model.name)
        text = self.tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in req.messages],
            add_generation_prompt=True,
            tokenize=False,
        )
        return await self._serve(req, text, None, request)

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        body = api.parse_body(await request.body(), request.headers.get("content-type"))
        req = api.parse_completion(body, self.config.model.name)
        if req.prompt_token_ids is not None:
            ids: list[int] | None = list(req.prompt_token_ids)
            vocab = len(self.tokenizer)
            if max(ids) >= vocab:
                raise api.InvalidRequest(
                    f"prompt token id {max(ids)} is outside the vocabulary (size {vocab})",
                    param="prompt",
                )
            return await self._serve(req, None, ids, request)
        assert req.prompt_text is not None
        return await self._serve(req, req.prompt_text, None, request)

    # ---- the turn ------------------------------------------------------------------

    def _max_tokens(self, req: api.ApiRequest, num_prompt: int) -> int:
        limit = self.config.model.max_model_len
        if num_prompt >= limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt has {num_prompt} tokens. Shorten the prompt or the history.",
                param="messages" if req.kind == "chat" else "prompt",
            )
        if req.max_tokens is None:
            return min(api.DEFAULT_MAX_TOKENS, limit - num_prompt)
        if num_prompt + req.max_tokens > limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt + req.max_tokens} tokens ({num_prompt} in the prompt, "
                f"{req.max_tokens} for the completion). Reduce the prompt or max_tokens.",
                param="max_tokens",
            )
        return req.max_tokens

    def _tokenize(self, req: api.ApiRequest, session_id: str | None, text: str) -> list[int]:
        tok = self.tokenizer
        special = req.kind == "completion"  # chat templates already carry BOS
        return self.session_tokens.encode(
            session_id,
            text,
            full=lambda t: tok.encode(t, add_special_tokens=special),
            suffix=lambda t: tok.encode(t, add_special_tokens=False),
            now_s=time.monotonic(),
        )

    def _remember(
        self,
        session_id: str | None,
        text: str | None,
        ids: list[int],
        out: _Output,
        report: TurnReport,
    ) -> None:
        """Keep the exact tokens of this turn for the session's next one (see
        ``orchestrator.session_tokens``). Stop strings cut text and tokens apart: skip."""
        if session_id is None:
            return
        out_ids = list(out.token_ids)
        if report.finish_reason == "stop":
            if not out_ids or out_ids[-1] != self.tokenizer.eos_token_id:
                self.session_tokens.forget(session_id)
                return
            out_ids.pop()  # the template writes the end-of-turn token itself
        covered_text = None if text is None else text + "".join(out.text)
        self.session_tokens.remember(session_id, covered_text, ids + out_ids, time.monotonic())

    async def _serve(
        self, req: api.ApiRequest, text: str | None, ids: list[int] | None, http: Request
    ) -> Any:
        session_id = api.parse_session_id(http.headers.get("x-session-id"))
        if ids is None:
            assert text is not None
            ids = self._tokenize(req, session_id, text)
        max_tokens = self._max_tokens(req, len(ids))
        rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        turn = self.router.run_turn(
            prompt_token_ids=ids,
            max_tokens=max_tokens,
            session_id=session_id,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            stop=req.stop,
            ignore_eos=req.ignore_eos,
            request_id=rid,
        )
        # Wait for the first item so that prefill failures become a proper status code.
        try:
            first = await turn.__anext__()
        except StopAsyncIteration:
            raise EngineUnavailable("the decode engine returned no output") from None
        headers = {"x-request-id": rid}
        if session_id is not None:
            headers["x-session-id"] = session_id
        if req.stream:
            return StreamingResponse(
                self._sse(req, rid, first, turn, (session_id, text, ids)),
                media_type="text/event-stream",
                headers=headers,
            )
        out = _Output()
        out.add(first[0])
        report = first[1]  # the router updates this one report as the turn goes
        try:
            async for chunk, _ in turn:
                out.add(chunk)
        finally:
            await turn.aclose()  # a cancelled request ends its turn now, not at GC
        self._remember(session_id, text, ids, out, report)
        make = api.chat_response if req.kind == "chat" else api.completion_response
        body = make(
            rid,
            req.model,
            "".join(out.text),
            report.finish_reason,
            _usage(report),
            report.as_dict(),
        )
        if req.return_token_ids:
            body["prompt_token_ids"] = ids
            body["choices"][0]["token_ids"] = out.token_ids
        return JSONResponse(body, headers=headers)

    async def _sse(
        self,
        req: api.ApiRequest,
        rid: str,
        first: tuple[GenerateChunk, TurnReport],
        turn: AsyncGenerator[tuple[GenerateChunk, TurnReport], None],
        session: tuple[str | None, str | None, list[int]],
    ) -> AsyncIterator[str]:
        item, is_first = first, True
        report = first[1]
        out = _Output()
        try:
            while True:
                chunk, report = item
                out.add(chunk)
                if chunk.text or is_first or chunk.finished:
                    yield api.stream_chunk(
                        req.kind,
                        rid,
                        req.model,
                        text=chunk.text,
                        first=is_first,
                        finish=chunk.finish_reason if chunk.finished else None,
                        ext=report.as_dict() if chunk.finished else None,
                    )
                    is_first = False
                if chunk.finished:
                    self._remember(session[0], session[1], session[2], out, report)
                    break
                item = await turn.__anext__()
        except RequestError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        except Exception as exc:
            log.exception("stream %s failed", rid)
            body = {
                "error": {
                    "message": f"{type(exc).__name__}: {exc}",
                    "type": "server_error",
                    "param": None,
                    "code": "stream_failed",
                }
            }
            yield f"data: {json.dumps(body)}\n\n"
        else:
            if req.include_usage:
                yield api.stream_chunk(
                    req.kind, rid, req.model, use=_usage(report), ext=report.as_dict()
                )
        finally:
            await turn.aclose()
        yield "data: [DONE]\n\n"
