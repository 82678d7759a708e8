"""API keys, session ownership and per-key limits for the OpenAI-compatible ingress.

Pure and synchronous: no Ray, no FastAPI, no wall clock (``now_s`` comes in). The ingress
owns one of each object below. For a turn, in this order (checks first, then the acts,
so that a refused request leaves no state behind):

1. ``Authenticator.authenticate(authorization_header)`` → ``Principal`` (401);
2. ``SessionOwners.check(session_id, principal, now_s)`` before the session's state is
   read, tokenization included (404 for another key's session);
3. ``check_request(principal, ...)`` once the prompt is tokenized (429), then
   ``principal.cap_max_tokens(max_tokens)`` for the value sent to the engines;
4. ``ConcurrencyGate.acquire(principal, num_sequences)`` → ``Ticket`` (429): a request
   of ``n`` choices counts ``n`` against ``max_concurrent_requests``;
5. ``SessionOwners.claim(session_id, principal, now_s)`` (release the ticket if it
   raises) and close the sessions it returns;
6. when the response has ended, however it ended: ``ConcurrencyGate.release(ticket)`` and
   ``SessionOwners.touch(session_id, principal, now_s)``.

Reading or closing a session needs only 1 and 2; after closing, ``SessionOwners.forget``.
An operator route needs 1 and ``require_operator`` (403 for a key without ``operator``).
The ingress's periodic tick calls ``SessionOwners.expire(now_s)`` and closes what it
returns.

Keys are stored only as SHA-256 hashes (``server.api_keys``); a presented key is hashed
and compared with ``hmac.compare_digest``. No message or repr contains a presented key.
With no keys configured every request is the ``ANONYMOUS`` principal, whatever header it
sends (the openai SDK always sends one), and sessions have no owners; config allows that
only on a loopback host (see ``orchestrator.config``).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from orchestrator.config import ApiKeyConfig
from orchestrator.errors import AuthenticationFailed, LimitExceeded, PermissionDenied
from orchestrator.kv.ownership import ANONYMOUS, Principal

__all__ = [
    "KEY_PREFIX",
    "Authenticator",
    "ConcurrencyGate",
    "Ticket",
    "check_request",
    "hash_key",
    "new_key",
    "require_operator",
]

KEY_PREFIX = "kvt-"
_HOW_TO_FIX = "send 'Authorization: Bearer <key>'; keys are configured under server.api_keys"
# Longer "keys" are not keys: refuse them before hashing (header size is bounded anyway).
_MAX_KEY_CHARS = 512


def hash_key(key: str) -> str:
    """The hex SHA-256 of ``key`` (what ``server.api_keys[].sha256`` holds)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def new_key() -> str:
    """A new random API key: ``kvt-`` and 43 URL-safe characters (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


class Authenticator:
    """Maps an ``Authorization`` header to a ``Principal``. Built once from
    ``config.server.api_keys``; ``authenticate`` is a side-effect-free query."""

    def __init__(self, keys: Iterable[ApiKeyConfig]) -> None:
        self._keys = tuple((bytes.fromhex(k.sha256), Principal.of(k)) for k in keys)

    @property
    def requires_key(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of a request, from its ``Authorization`` header value.

        Raises ``AuthenticationFailed`` (401) when keys are configured and the header is
        missing, is not ``Bearer <key>``, or holds no configured key. With no keys
        configured returns ``ANONYMOUS`` and ignores the header.
        """
        if not self._keys:
            return ANONYMOUS
        if authorization is None or not authorization.strip():
            raise AuthenticationFailed(f"missing API key: {_HOW_TO_FIX}")
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key or " " in key or len(key) > _MAX_KEY_CHARS:
            raise AuthenticationFailed(
                f"malformed Authorization header (expected 'Bearer <key>'): {_HOW_TO_FIX}"
            )
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        found: Principal | None = None
        for stored, principal in self._keys:  # no early exit: time does not tell which
            if hmac.compare_digest(digest, stored):
                found = principal
        if found is None:
            raise AuthenticationFailed(f"invalid API key: {_HOW_TO_FIX}")
        return found


def check_request(
    principal: Principal,
    *,
    num_prompt_tokens: int,
    max_tokens: int | None,
    prompt_param: str = "messages",
) -> None:
    """Raise ``LimitExceeded`` (429) when a request is over its key's limits.

    ``max_tokens`` is what the client asked for (``None``: it did not say; then cap the
    default with ``principal.cap_max_tokens`` instead of refusing). ``prompt_param`` is
    the body field the prompt came in (``messages`` or ``prompt``).
    """
    limit = principal.max_prompt_tokens
    if limit is not None and num_prompt_tokens > limit:
        raise LimitExceeded(
            f"the prompt has {num_prompt_tokens} tokens; API key {principal.name!r} allows at "
            f"most {limit} (max_prompt_tokens). Shorten the prompt or the history.",
            code="prompt_too_long_for_key",
            param=prompt_param,
        )
    limit = principal.max_tokens
    if limit is not None and max_tokens is not None and max_tokens > limit:
        raise LimitExceeded(
            f"max_tokens is {max_tokens}; API key {principal.name!r} allows at most {limit} "
            "per request. Lower max_tokens.",
            code="max_tokens_over_key_limit",
            param="max_tokens",
        )


def require_operator(principal: Principal, route: str) -> None:
    """Raise ``PermissionDenied`` (403) unless ``principal`` may call the operator route
    ``route`` (an operator's key, or no keys configured at all)."""
    if not principal.may_operate:
        raise PermissionDenied(
            f"{route} is an operator route: API key {principal.name!r} is not an operator's. "
            "Call it with a key that has operator: true under server.api_keys."
        )


@dataclass(frozen=True, slots=True)
class Ticket:
    """One admitted request, returned by ``ConcurrencyGate.acquire``; hand it back to
    ``release`` when the response has ended."""

    key_name: str
    serial: int


# Serials are unique in the process, so a ticket matches only the gate that issued it.
_serials = itertools.count(1)


class ConcurrencyGate:
    """Counts each key's sequences in flight (a request's, or each of its ``n`` choices)
    and refuses a request that would take the key over its ``max_concurrent_requests``
    with 429 ``concurrency_limit_exceeded``; one of more choices than the limit (it could
    never run) with 429 ``n_over_key_limit``, naming ``n``.

    Exact by construction: the count of a key is the sum of its live tickets'. A refused
    request gets no ticket and changes nothing. ``release`` is idempotent: a ticket counts
    once, and releasing it again (or a ticket of another gate) does nothing, so a
    ``finally`` that releases can never drift the count or mask the original error.
    Not thread-safe: use it from the ingress's event loop.
    """

    def __init__(self, *, retry_after_s: float = 1.0) -> None:
        self.retry_after_s = retry_after_s
        # Each key's live tickets: serial -> the number of sequences it counts.
        self._live: dict[str, dict[int, int]] = {}

    def num_in_flight(self, principal: Principal) -> int:
        """The key's sequences in flight (a request of ``n`` choices counts ``n``)."""
        return sum(self._live.get(principal.name, {}).values())

    def can_acquire(self, principal: Principal, num_sequences: int = 1) -> bool:
        limit = principal.max_concurrent_requests
        return limit is None or self.num_in_flight(principal) + num_sequences <= limit

    def acquire(self, principal: Principal, num_sequences: int = 1) -> Ticket:
        """Admit one request of ``principal`` running ``num_sequences`` sequences (its
        ``n`` choices) or raise ``LimitExceeded`` (429)."""
        limit = principal.max_concurrent_requests
        if limit is not None and num_sequences > limit:
            raise LimitExceeded(
                f"n is {num_sequences}; API key {principal.name!r} runs at most {limit} "
                f"sequences at once (max_concurrent_requests, each choice counts one). "
                f"Send n of at most {limit}.",
                code="n_over_key_limit",
                param="n",
            )
        if not self.can_acquire(principal, num_sequences):
            in_flight = self.num_in_flight(principal)
            asked = "" if num_sequences == 1 else f"; this one asks {num_sequences} (n)"
            raise LimitExceeded(
                f"API key {principal.name!r} already has {in_flight} requests in flight "
                f"(each choice of a request with n counts one){asked}, its limit "
                f"(max_concurrent_requests = {limit}); retry when one has finished.",
                code="concurrency_limit_exceeded",
                retry_after_s=self.retry_after_s,
            )
        ticket = Ticket(principal.name, next(_serials))
        self._live.setdefault(ticket.key_name, {})[ticket.serial] = num_sequences
        return ticket

    def release(self, ticket: Ticket) -> None:
        """End ``ticket``'s request (idempotent; see the class docstring)."""
        live = self._live.get(ticket.key_name)
        if live is None:
            return
        live.pop(ticket.serial, None)
        if not live:  # keep memory to keys with requests in flight
            del self._live[ticket.key_name]

    @contextmanager
    def admitted(self, principal: Principal) -> Iterator[Ticket]:
        """``acquire`` on entry, ``release`` on exit: for a response that ends in the block
        (a streamed one ends later: keep its ticket and release it when the stream ends)."""
        ticket = self.acquire(principal)
        try:
            yield ticket
        finally:
            self.release(ticket)
