"""vLLM's ``EngineClient`` over kvtide's turn: vLLM's OpenAI serving layer drives it.

vLLM's serving classes (``OpenAIServingChat``, ``OpenAIServingCompletion``) validate the
request, render the chat template (with tools), build vLLM's ``SamplingParams`` (tool
choice and structured outputs, logprobs, logit bias, stop, ...) and call
``engine_client.generate(prompt, sampling_params, request_id)``; they turn what it
yields (``RequestOutput``s) into the response: tool-call and reasoning parsing,
logprobs, usage. This client is that engine: each ``generate`` is one kvtide turn (the
session claimed, the KV plan, prefill → NIXL → decode through the ``Router``), its
decode chunks rebuilt as ``RequestOutput``s.

The HTTP request the turn belongs to (its key, session header, span) reaches
``generate`` as a ``TurnContext`` set by the ingress in a context variable before it
calls the serving class (``generate`` is called in the request's own task). The turn
itself is run by the ingress's ``TurnRunner``: this module only adapts shapes.

``n`` > 1: choice 0 is the turn (it carries the session and its KV); choices 1..n-1
are sessionless requests of the same prompt ids, started once choice 0's prefill is
done, so the prefill engine's prefix cache holds the prompt (computed once), each with
vLLM's per-choice seed (``seed + index``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from engines.base import GenerateChunk, TokenLogprob
from orchestrator.errors import ServingLayerRefused

if TYPE_CHECKING:
    from orchestrator.kv.ownership import Principal
    from orchestrator.router import TurnReport

__all__ = ["CURRENT_TURN", "Kind", "TurnContext", "TurnEngine", "TurnRunner", "make_turn_client"]


Kind = Literal["chat", "completion", "responses"]
"""The API a request came in by (vLLM's serving class that takes it)."""


@dataclass(slots=True, kw_only=True, eq=False)
class TurnContext:
    """One HTTP request's facts for its turn, and what the turn left for the response.

    Set by the ingress before it calls vLLM's serving class; ``generate`` reads it.
    ``sessionless``: the turn runs in no session, even one its text would continue;
    ``num_choices``: the request's ``n`` (each choice a sequence on the pools);
    ``may_extend``: the request's ``x-kvtide-kv-plan`` (``Turn.may_extend``);
    ``on_done``: called once the response is complete. The rest is written by the turn:
    ``max_tokens`` (the cap its limits set, which the further choices take too),
    ``prompt_token_ids`` (as the turn tokenized them) and the response's ``headers``
    once it is opened; ``report`` (choice 0's ``TurnReport``); ``raw_text`` (choice 0's
    text as generated); ``error`` (a failure before the first token, raised by the
    ingress as its status instead of an error event in a stream)."""

    kind: Kind
    principal: Principal
    session_header: str | None
    has_history: bool
    sessionless: bool = False
    may_extend: bool = True
    requested_max_tokens: int | None
    prompt_param: str
    num_choices: int = 1
    on_done: Callable[[], None] | None = None
    root: Any
    t_in: float
    max_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    headers: dict[str, str] | None = None
    report: TurnReport | None = None
    raw_text: list[str] = field(default_factory=list)
    error: BaseException | None = None


CURRENT_TURN: contextvars.ContextVar[TurnContext] = contextvars.ContextVar("kvtide_turn")

TurnStream = AsyncGenerator[tuple[GenerateChunk, Any], None]
TurnRunner = Callable[[TurnContext, list[int], str | None, Any, str, bool], TurnStream]
"""``(context, prompt ids, prompt text, sampling params, request id, is_turn)``: the
turn's stream (``is_turn`` False: a sessionless extra choice of the same prompt)."""


def _logprobs(positions: Iterable[list[TokenLogprob]]) -> list[dict[int, Any]]:
    from vllm.logprobs import Logprob

    return [
        {c.token_id: Logprob(logprob=c.logprob, rank=c.rank, decoded_token=c.decoded) for c in p}
        for p in positions
    ]


def _prompt_logprobs(positions: list[list[TokenLogprob] | None] | None) -> Any:
    """The prefill's prompt log probabilities in vLLM's shape (None at the first)."""
    if positions is None:
        return None
    return [None if p is None else _logprobs([p])[0] for p in positions]


class _Choice:
    """One choice's output so far (cumulative, for vLLM's FINAL_ONLY requests)."""

    __slots__ = ("cumulative", "finish", "ids", "logprobs", "stop", "text")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[list[TokenLogprob]] | None = None
        self.cumulative: float | None = None
        self.finish: str | None = None
        self.stop: int | str | None = None

    def add(self, chunk: GenerateChunk) -> None:
        self.text.append(chunk.text)
        self.ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            self.logprobs = [*(self.logprobs or ()), *chunk.logprobs]
        self.cumulative = chunk.cumulative_logprob
        if chunk.finished:
            self.finish, self.stop = chunk.finish_reason, chunk.stop_reason


def _completion(index: int, chunk: GenerateChunk | _Choice, want_logprobs: bool) -> Any:
    from vllm.outputs import CompletionOutput

    if isinstance(chunk, _Choice):
        text, ids, lps = "".join(chunk.text), chunk.ids, chunk.logprobs
        cumulative, finish, stop = chunk.cumulative, chunk.finish, chunk.stop
    else:
        text, ids, lps = chunk.text, chunk.token_ids, chunk.logprobs
        cumulative = chunk.cumulative_logprob
        finish = chunk.finish_reason if chunk.finished else None
        stop = chunk.stop_reason if chunk.finished else None
    logprobs = None
    if want_logprobs:
        logprobs = _logprobs(lps or ())
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=list(ids),
        cumulative_logprob=cumulative,
        logprobs=logprobs,
        finish_reason=finish,
        stop_reason=stop,
    )


async def _merged(
    streams: Mapping[int, TurnStream],
) -> AsyncGenerator[tuple[int, GenerateChunk], None]:
    """The choices' chunks as they come, each with its choice's index."""
    queue: asyncio.Queue[tuple[int, GenerateChunk] | tuple[int, BaseException] | None] = (
        asyncio.Queue()
    )

    async def pump(index: int, stream: TurnStream) -> None:
        try:
            async for chunk, _ in stream:
                queue.put_nowait((index, chunk))
        except BaseException as exc:
            queue.put_nowait((index, exc))
            raise
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in streams.items()]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
                continue
            index, got = item
            if isinstance(got, BaseException):
                raise got
            yield index, got
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


def _refused(message: str, param: str | None) -> ServingLayerRefused:
    return ServingLayerRefused(message, param, status_code=400, error_type="invalid_request_error")


def _checked(input_processor: Any, params: Any) -> ServingLayerRefused | None:
    """vLLM's own checks of the parameters against the model (its API server runs them
    before the engine sees a request: max logprobs, structured output specs, token ids
    in the vocabulary, ...)."""
    from vllm.exceptions import VLLMClientError

    try:
        input_processor._validate_params(params, ("generate",))
    except (ValueError, VLLMClientError) as exc:
        message = str(exc.args[0]) if exc.args else "invalid sampling parameters"
        return _refused(message, getattr(exc, "parameter", None))
    return None


async def _outputs(
    streams: Mapping[int, TurnStream], params: Any, ctx: TurnContext
) -> AsyncGenerator[tuple[list[Any], bool], None]:
    """The choices' chunks as vLLM's ``CompletionOutput``s, in the request's output kind
    (each delta as it comes, or every choice whole at the end), with whether all are
    finished; choice 0's text is kept as generated (``tool_turns``)."""
    from vllm.sampling_params import RequestOutputKind

    want_logprobs = params.logprobs is not None
    delta = params.output_kind == RequestOutputKind.DELTA
    choices = {i: _Choice() for i in streams}
    num_finished = 0
    async for index, chunk in _merged(streams):
        if index == 0:
            ctx.raw_text.append(chunk.text)
        num_finished += chunk.finished
        finished = num_finished == len(streams)
        if delta:
            yield [_completion(index, chunk, want_logprobs)], finished
        else:
            choices[index].add(chunk)
            if finished:
                yield [_completion(i, c, want_logprobs) for i, c in choices.items()], True


INLINE_MAX_CHARS = 8192
"""Prompts and conversations up to this many characters are rendered and tokenized on
the event loop, as kvtide's own layer does (``turn_opening.INLINE_MAX_CHARS``): vLLM's
renderer sends both to a thread pool, a hop that costs more than the work."""


def _inline_when_short(renderer: Any) -> None:
    """``renderer``'s chat template and tokenizing run inline for short inputs (this
    renderer only; longer ones keep vLLM's thread pool)."""
    from vllm.renderers import hf

    tokenize, tokenize_async = renderer._tokenize_prompt, renderer._tokenize_prompt_async

    async def tokenize_inline(prompt: Any, params: Any) -> Any:
        text = prompt.get("prompt") if isinstance(prompt, dict) else None
        if isinstance(text, str) and len(text) <= INLINE_MAX_CHARS:
            return tokenize(prompt, params)
        return await tokenize_async(prompt, params)

    renderer._tokenize_prompt_async = tokenize_inline
    template_async = getattr(renderer, "_apply_chat_template_async", None)
    if template_async is None:
        return

    async def template_inline(
        model_config: Any, tokenizer: Any, conversation: Any, **kw: Any
    ) -> Any:
        size = sum(len(str(m.get("content") or "")) for m in conversation)
        if size <= INLINE_MAX_CHARS:
            return hf.safe_apply_chat_template(model_config, tokenizer, conversation, **kw)
        return await template_async(model_config, tokenizer, conversation, **kw)

    renderer._apply_chat_template_async = template_inline


class TurnEngine:
    """What vLLM's serving classes ask of an engine, answered by kvtide's turns (the
    methods of vLLM's ``EngineClient``; ``make_turn_client`` registers it as one)."""

    def __init__(self, vllm_config: Any, run: TurnRunner) -> None:
        from vllm.renderers import renderer_from_config
        from vllm.v1.engine.input_processor import InputProcessor

        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer_from_config(vllm_config)
        _inline_when_short(self.renderer)
        self.input_processor = InputProcessor(vllm_config, self.renderer)
        self._run = run

    # ---- the data plane ------------------------------------------------------------

    def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, **_: Any
    ) -> AsyncGenerator[Any, None]:
        # Called in the HTTP request's task (or its stream's): its context is the turn's.
        return self._generate(CURRENT_TURN.get(), prompt, sampling_params, request_id)

    async def _first(
        self, ctx: TurnContext, ids: list[int], text: str | None, params: Any, rid: str
    ) -> tuple[TurnStream, GenerateChunk, Any]:
        """The turn started and its first item, or ``ctx.error`` set and raised."""
        refused = _checked(self.input_processor, params)
        if refused is not None:
            ctx.error = refused
            raise refused
        turn = self._run(ctx, ids, text, params, rid, True)
        try:
            first, report = await turn.__anext__()
        except BaseException as exc:
            ctx.error = exc
            raise
        if params.logprobs is not None and first.token_ids and first.logprobs is None:
            await turn.aclose()
            ctx.error = _refused(
                "logprobs are not available: this deployment's engines return none (the "
                "simulated backend samples nothing); leave logprobs out",
                "logprobs",
            )
            raise ctx.error
        ctx.report = report
        return turn, first, report

    async def _generate(
        self, ctx: TurnContext, prompt: Any, params: Any, request_id: str
    ) -> AsyncGenerator[Any, None]:
        from vllm.outputs import RequestOutput

        text = prompt.get("prompt")
        turn, first, report = await self._first(
            ctx, list(prompt["prompt_token_ids"]), text, params, request_id
        )
        ids = ctx.prompt_token_ids  # as the turn tokenized them (set once it opened)
        assert ids is not None

        async def choice_zero() -> TurnStream:
            yield first, report
            async for item in turn:
                yield item

        streams: dict[int, TurnStream] = {0: choice_zero()}
        for index in range(1, max(1, params.n)):
            child = params.clone()
            if child.seed is not None:
                child.seed += index
            streams[index] = self._run(ctx, ids, text, child, f"{request_id}-c{index}", False)
        prompt_logprobs = _prompt_logprobs(report.prompt_logprobs)
        async for outputs, finished in _outputs(streams, params, ctx):
            yield RequestOutput(
                request_id=request_id,
                prompt=text,
                prompt_token_ids=ids,
                prompt_logprobs=prompt_logprobs,
                outputs=outputs,
                finished=finished,
                num_cached_tokens=report.num_cached_tokens,
            )

    async def abort(self, request_id: Any) -> None:
        """A turn ends when its stream is closed (the serving layer's generator)."""

    # ---- the control plane: what vLLM's serving classes ask of an engine ------------

    @property
    def is_running(self) -> bool:
        return True

    @property
    def is_stopped(self) -> bool:
        return False

    @property
    def errored(self) -> bool:
        return False

    @property
    def dead_error(self) -> BaseException:
        return RuntimeError("kvtide's turn client does not fail as a whole")

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """Admitted: the ingress's guard has counted the request's ``n`` sequences."""

    async def is_tracing_enabled(self) -> bool:
        return False

    async def check_health(self) -> None:
        return None

    async def do_log_stats(self) -> None:
        return None

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("kvtide serves generation only (no pooling models)")

    async def notify_kv_transfer_request_rejected(self, *args: Any, **kwargs: Any) -> None:
        return None

    def _unsupported(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("not an operation kvtide's OpenAI endpoint offers")

    start_profile = stop_profile = reset_mm_cache = reset_encoder_cache = _unsupported
    reset_prefix_cache = sleep = wake_up = release_kv_cache_memory = _unsupported
    add_lora = pause_generation = resume_generation = _unsupported

    async def is_sleeping(self) -> bool:
        return False

    async def is_paused(self) -> bool:
        return False

    def shutdown(self, *args: Any, **kwargs: Any) -> None:
        return None


def make_turn_client(vllm_config: Any, run: TurnRunner) -> TurnEngine:
    """A ``TurnEngine`` on ``vllm_config``'s model whose turns ``run`` runs, registered
    as a vLLM ``EngineClient`` (it answers all of that interface's methods vLLM's
    serving classes call). vLLM is imported here, in the ingress replica only."""
    from vllm.engine.protocol import EngineClient

    EngineClient.register(TurnEngine)
    return TurnEngine(vllm_config, run)
