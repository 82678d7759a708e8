"""The ``server`` section of kvtide's config: bind address, API keys, and the refusal to
serve unauthenticated beyond loopback.

Each section is one frozen pydantic model: validated at the edge (YAML) and used as is
by the orchestrator. ``orchestrator.config`` assembles the whole file from this and its
other sections.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from orchestrator.errors import ConfigError

__all__ = [
    "NODE_ADDRESS",
    "ApiKeyConfig",
    "ServerConfig",
    "StrictSection",
    "check_internal_host",
    "check_server",
    "internal_address",
    "is_loopback_host",
    "nixl_transport_env",
]


class StrictSection(BaseModel):
    """A config section: unknown fields are errors, values are frozen (hashable, and
    picklable for Ray actors and Serve deployments), types are strict (``port: true`` or
    ``port: "80"`` is not a port; an integer is a valid float) and numbers finite
    (``.inf`` and ``.nan`` are refused). Derive a changed copy with
    ``model_copy(update=...)``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def _tuple_of_list(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


FROM_YAML_LIST = BeforeValidator(_tuple_of_list)
"""A tuple field's validator: YAML gives a list; the frozen config holds a tuple
(hashable)."""


_KEY_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


class ApiKeyConfig(StrictSection):
    """One accepted API key: its name, the SHA-256 of its token and its limits
    (``None``: no limit from the key)."""

    name: str = Field(
        description="The key's name, unique: appears in logs and metrics (not a secret)."
    )
    sha256: str = Field(
        description="Hex SHA-256 of the key (64 lowercase hex characters; `kvtide key new` "
        "prints one). Never the key itself."
    )
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="Longest prompt (tokens) this key may send; longer gets 429 "
        "prompt_too_long_for_key. Empty: only the model's context length applies.",
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="Most completion tokens per request: a larger explicit max_tokens gets "
        "429 max_tokens_over_key_limit, an omitted one is capped to it. Empty: no key limit.",
    )
    max_concurrent_requests: int | None = Field(
        None,
        ge=1,
        description="Requests of this key in flight at once; one more gets 429 "
        "concurrency_limit_exceeded with Retry-After. Empty: no key limit.",
    )
    operator: bool = Field(
        False,
        description="An operator's key: it may call the operator routes (POST "
        "/kvtide/integrity/reuse) and sees every tenant's session and request ids in "
        "/kvtide/stats. Other keys get 403 operator_key_required there, and see only their "
        "own ids (see docs/auth.md).",
    )
    max_sessions: int = Field(
        1000,
        ge=1,
        description="Sessions this key may own at once; a turn that would open one more gets "
        "429 session_limit_exceeded (close one with DELETE /kvtide/sessions/{id}, or let one "
        "expire). Other keys' sessions are never closed to make room.",
    )

    @field_validator("name")
    @classmethod
    def _name_chars(cls, name: str) -> str:
        if not _KEY_NAME_RE.fullmatch(name):
            raise ValueError(
                f"key name {name[:70]!r} must be 1-64 letters, digits and ._- "
                "starting with a letter or digit"
            )
        return name

    @field_validator("sha256")
    @classmethod
    def _hex_sha256(cls, value: str) -> str:
        # Never echo the value: a key pasted here by mistake must not reach the logs.
        if not _SHA256_RE.fullmatch(value):
            looks_like_key = " (it looks like a key: put the key's hash here)"
            raise ValueError(
                "must be the hex SHA-256 of the key, 64 lowercase hex characters; got "
                f"{len(value)} characters{looks_like_key if value.startswith('kvt-') else ''}. "
                "`kvtide key new` prints a key and its hash"
            )
        return value


NODE_ADDRESS = "node"
"""``server.internal_host``'s value for "this node's own address, as Ray knows it"."""


class ServerConfig(StrictSection):
    """How the OpenAI API is served: bind address, keys, request limits (``check_server``
    refuses unauthenticated listeners beyond loopback)."""

    host: str = Field("127.0.0.1", description="HTTP bind address (loopback by default).")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the OpenAI API.")
    route_prefix: str = Field(
        "/",
        description="Serve route prefix of the app: '/' or a path such as '/kvtide' "
        "(starting with '/', no trailing '/').",
    )
    api_keys: Annotated[tuple[ApiKeyConfig, ...], FROM_YAML_LIST] = Field(
        (),
        description="API keys the OpenAI API accepts ('Authorization: Bearer <key>'), kept as "
        "SHA-256 hashes (see docs/auth.md). Empty: requests need no key, which is allowed "
        "only on a loopback server.host unless allow_unauthenticated is set.",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Serve on purpose without authentication on a non-loopback address: the "
        "API with no api_keys, or the Ray dashboard on a non-loopback dashboard_host. "
        "Configured keys are still required.",
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        le=86_400,
        description="The deadline of one request, from receipt to its last token: prefill, "
        "KV transfer and decode together. Past it the request ends with 503 "
        "deadline_exceeded (a stream with a final error event) and its engine work is "
        "aborted.",
    )
    internal_host: str = Field(
        "127.0.0.1",
        description="Address of the listeners kvtide starts for its own parts: each "
        "engine's NIXL side channel, the host tier stores' NIXL handshake, the prefill "
        "engines' KV-event publishers. Peers dial it, and it has no authentication. "
        "Loopback (the default) serves a single-node deployment. On a cluster of several "
        "nodes set 'node': each listener binds its own node's address as Ray knows it "
        "(keep that network closed to all but the cluster's nodes, as for Ray's own ports); "
        "kvtide refuses to deploy a loopback internal_host on a cluster whose nodes have "
        "more than one address.",
    )
    dashboard_host: str = Field(
        "127.0.0.1",
        description="Bind address of the Ray dashboard of a locally started Ray. The "
        "dashboard (and its job API) has no authentication: a non-loopback address needs "
        "allow_unauthenticated.",
    )
    max_request_bytes: int = Field(
        4 * 2**20,
        ge=1024,
        le=2**30,
        description="Largest request body the API reads, in bytes; a larger one gets 413 "
        "before it is read (from its Content-Length) or as soon as it passes the limit.",
    )
    request_body_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Longest time the API waits for a request's whole body, from the "
        "moment it starts reading it; past it the request gets 408 request_timeout (a "
        "client that declares a body and sends it slowly, or never, holds nothing longer).",
    )
    stream_chunk_tokens: int = Field(
        16,
        ge=1,
        le=4096,
        description="With stream_chunk_window_ms above 0: most tokens an engine host "
        "holds back and sends the ingress in one chunk of a stream (one Serve hop). 1: a "
        "hop per engine step.",
    )
    stream_chunk_window_ms: float = Field(
        0.0,
        ge=0,
        le=1000,
        description="0 (default): every engine output leaves as the engine makes it, and "
        "the client gets an SSE event per engine step (outputs that queue up while the "
        "host is busy leave together, as in vLLM's own server). Above 0, opted into: how "
        "long a token may be held back for company (ms), so that a stream's tokens after "
        "its first leave at most this often, in chunks of up to stream_chunk_tokens (the "
        "first token and the last never wait): fewer Serve hops, tokens in bursts.",
    )
    responses_max_mib: float = Field(
        256.0,
        gt=0,
        le=2**20,
        description="Most MiB of stored responses (the Responses API: each response's "
        "conversation and output as vLLM keeps them, counted as JSON) one ingress "
        "replica keeps, all keys together; past it the oldest go first.",
    )
    responses_max_mib_per_key: float = Field(
        64.0,
        gt=0,
        le=2**20,
        description="Most MiB of stored responses one API key (or, without keys, all "
        "requests) keeps on one ingress replica; past it that key's oldest go first, "
        "and a response whose conversation alone is larger gets 429 "
        "response_too_large_to_store before its turn runs.",
    )

    step_streams: bool = Field(
        True,
        description="Decode engines send each ingress replica every engine step's new "
        "tokens for all its requests as one message on one standing Serve stream (as "
        "vLLM's engine core hands its API server one message per step), instead of one "
        "Serve stream item per request and step. false: each request's tokens on its "
        "own Serve stream.",
    )

    @property
    def requires_api_key(self) -> bool:
        return bool(self.api_keys)

    @field_validator("route_prefix")
    @classmethod
    def _route_prefix(cls, value: str) -> str:
        # Serve refuses these when the app is deployed, after the engines have started.
        if value != "/" and (
            not value.startswith("/")
            or value.endswith("/")
            or not all(c.isalnum() or c in "/._~-" for c in value)
            or "//" in value
        ):
            raise ValueError(
                f"route prefix {value[:40]!r} must be '/' or a path that starts with '/' and "
                "does not end with one (e.g. '/kvtide'), of letters, digits and ._~-"
            )
        return value

    @field_validator("internal_host")
    @classmethod
    def _internal_host(cls, value: str) -> str:
        if value != NODE_ADDRESS:
            try:
                ipaddress.IPv4Address(value)
            except ValueError:
                raise ValueError(
                    f"{value[:60]!r} is neither an IPv4 address nor {NODE_ADDRESS!r}: use "
                    f"127.0.0.1 on one node, {NODE_ADDRESS!r} on a cluster of several"
                ) from None
        return value

    @field_validator("api_keys")
    @classmethod
    def _unique_keys(cls, keys: tuple[ApiKeyConfig, ...]) -> tuple[ApiKeyConfig, ...]:
        names: set[str] = set()
        by_hash: dict[str, str] = {}
        for key in keys:
            if key.name in names:
                raise ValueError(f"key names must be unique; {key.name!r} appears twice")
            names.add(key.name)
            if key.sha256 in by_hash:
                raise ValueError(
                    f"keys {by_hash[key.sha256]!r} and {key.name!r} have the same sha256; "
                    "give each its own key (`kvtide key new`)"
                )
            by_hash[key.sha256] = key.name
        return keys


def is_loopback_host(host: str) -> bool:
    """``localhost`` or a loopback IP (127.0.0.0/8, ::1). Other names are not: kvtide
    cannot know what they resolve to."""
    name = host.strip().removeprefix("[").removesuffix("]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_server(s: ServerConfig) -> ServerConfig:
    """The server section, checked: unauthenticated listeners beyond loopback are refused
    unless ``allow_unauthenticated`` says so."""
    if not s.allow_unauthenticated:
        if not s.api_keys and not is_loopback_host(s.host):
            raise ConfigError(
                f"invalid kvtide config: server.host: {s.host!r} is not a loopback address "
                "and server.api_keys is empty, so anyone who reaches it could use the API. "
                "Add a key under server.api_keys (`kvtide key new` prints one), bind "
                "127.0.0.1, or set server.allow_unauthenticated: true to serve without keys "
                "on purpose",
                field="server.host",
            )
        if not is_loopback_host(s.dashboard_host):
            raise ConfigError(
                f"invalid kvtide config: server.dashboard_host: {s.dashboard_host!r} is not a "
                "loopback address; the Ray dashboard and its job API have no authentication, "
                "so anyone who reaches it can run code on the cluster. Bind 127.0.0.1 (use an "
                "SSH tunnel) or set server.allow_unauthenticated: true to expose it on purpose",
                field="server.dashboard_host",
            )
    return s


def internal_address(internal_host: str, node_ip: str) -> str:
    """The address a listener for kvtide's own parts binds on a node whose address (as
    Ray knows it) is ``node_ip``: ``server.internal_host``, or ``node_ip`` for 'node'."""
    return node_ip if internal_host == NODE_ADDRESS else internal_host


def check_internal_host(internal_host: str, node_ips: set[str]) -> None:
    """Refuse a loopback ``server.internal_host`` on a cluster whose nodes have more than
    one address: an engine there could not reach its peers' side channels."""
    if len(node_ips) > 1 and is_loopback_host(internal_host):
        raise ConfigError(
            f"invalid kvtide config: server.internal_host: {internal_host!r} is a loopback "
            f"address, but the Ray cluster's nodes have {len(node_ips)} addresses "
            f"({', '.join(sorted(node_ips))}), so engines on different nodes could not "
            f"reach each other's NIXL side channels. Set server.internal_host: "
            f"{NODE_ADDRESS!r}",
            field="server.internal_host",
        )


def nixl_transport_env(internal_host: str) -> dict[str, str]:
    """The environment of a process with a NIXL agent (an engine, a host store) for
    ``server.internal_host``. NIXL's UCX backend listens on every network device of the
    host (its TCP transport); on loopback, UCX is held to the loopback device (processes
    of one host still move KV through shared memory, and on GPUs through CUDA IPC)."""
    return {"UCX_NET_DEVICES": "lo"} if is_loopback_host(internal_host) else {}
