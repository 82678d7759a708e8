"""The public arguments that the sync and async shells take alike, each declared once.

``Client.session`` and ``AsyncClient.session`` take ``session_arguments``'s parameters;
``send`` and ``stream`` of ``Session`` and ``AsyncSession`` take ``turn_arguments``'s.
``takes_arguments_of(parse)`` (``awaits_arguments_of`` for a coroutine method) gives a
method those parameters (for callers, type checkers and ``inspect.signature`` alike) and
hands it what ``parse`` made of them, so that the four methods of a turn cannot drift
apart in what they accept.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

from orchestrator.sdk._state import ConversationState
from orchestrator.sdk._wire import TurnOptions

DEFAULT_RENEW_EVERY_S = 120.0

P = ParamSpec("P")
A = TypeVar("A")
S = TypeVar("S")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., object])


def takes_arguments_of(
    parse: Callable[P, A],
) -> Callable[[Callable[[S, A], R]], Callable[Concatenate[S, P], R]]:
    """A decorator: the method takes ``parse``'s parameters after ``self`` and is called
    with what ``parse`` returns for them. Its name and docstring stay the method's."""

    def decorate(method: Callable[[S, A], R]) -> Callable[Concatenate[S, P], R]:
        @functools.wraps(method)
        def call(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
            return method(self, parse(*args, **kwargs))

        return _signed(call, method, parse)

    return decorate


def awaits_arguments_of(
    parse: Callable[P, A],
) -> Callable[
    [Callable[[S, A], Awaitable[R]]], Callable[Concatenate[S, P], Coroutine[Any, Any, R]]
]:
    """``takes_arguments_of`` for a coroutine method: the method stays one (``async def``,
    as ``inspect.iscoroutinefunction`` sees it)."""

    def decorate(
        method: Callable[[S, A], Awaitable[R]],
    ) -> Callable[Concatenate[S, P], Coroutine[Any, Any, R]]:
        @functools.wraps(method)
        async def call(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
            return await method(self, parse(*args, **kwargs))

        return _signed(call, method, parse)

    return decorate


def _signed(call: F, method: Callable[..., object], parse: Callable[..., object]) -> F:
    """``call`` as callers see it: ``method``'s ``self`` and return, ``parse``'s parameters."""
    own = inspect.signature(method)
    first = next(iter(own.parameters.values()))
    call.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [first, *inspect.signature(parse).parameters.values()],
        return_annotation=own.return_annotation,
    )
    return call


def session_arguments(
    session_id: str | None = None,
    *,
    model: str | None = None,
    system: str | None = None,
    messages: Sequence[Mapping[str, Any]] | None = None,
    renew_every_s: float | None = DEFAULT_RENEW_EVERY_S,
) -> ConversationState:
    """A new session's state. ``session_id`` defaults to a new random id; pass an old one
    (with its ``messages``) to resume. ``model`` defaults to the first of
    ``GET /v1/models``. ``renew_every_s=None`` turns background lease renewal off."""
    return ConversationState(
        session_id=session_id,
        model=model,
        system=system,
        messages=messages,
        renew_every_s=renew_every_s,
    )


@dataclass(frozen=True, slots=True)
class TurnArgs:
    """What ``send`` and ``stream`` were asked: the user message (if any) and the rest."""

    user_text: str | None
    options: TurnOptions


def turn_arguments(
    user_text: str | None = None,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    response_format: Mapping[str, Any] | type | None = None,
    logprobs: bool | None = None,
    top_logprobs: int | None = None,
    extra_body: Mapping[str, Any] | None = None,
    traceparent: str | None = None,
    idempotency_key: str | None = None,
    **sampling: Any,
) -> TurnArgs:
    """One turn's arguments (see ``Session.send``); keyword arguments not named here go
    into the body as they are."""
    options = TurnOptions(
        max_tokens=max_tokens,
        temperature=temperature,
        tools=tools,
        tool_choice=tool_choice,
        response_format=response_format,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        extra_body=extra_body,
        sampling=sampling,
        traceparent=traceparent,
        idempotency_key=idempotency_key,
    )
    return TurnArgs(user_text, options)
