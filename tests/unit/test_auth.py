"""API keys, session ownership and per-key limits (orchestrator.serve.auth), their config
and the `kvtide key new` command. Clocks are passed in: no test sleeps."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import pytest
import yaml

from orchestrator.cli.main import main
from orchestrator.config import ApiKeyConfig, parse_config
from orchestrator.errors import (
    AuthenticationFailed,
    ConfigError,
    LimitExceeded,
    RequestError,
    SessionNotFound,
    TurnInProgress,
)
from orchestrator.kv.ownership import ANONYMOUS, Principal, SessionOwners, session_not_found
from orchestrator.serve.auth import (
    Authenticator,
    ConcurrencyGate,
    check_request,
    hash_key,
    new_key,
)

KEY_A = "kvt-alpha-secret-0123456789"
KEY_B = "kvt-bravo-secret-9876543210"


def _keys() -> tuple[ApiKeyConfig, ...]:
    return (
        ApiKeyConfig(name="team-a", sha256=hash_key(KEY_A), max_tokens=256),
        ApiKeyConfig(
            name="team-b",
            sha256=hash_key(KEY_B),
            max_prompt_tokens=1000,
            max_tokens=128,
            max_concurrent_requests=2,
        ),
    )


def _error_json(exc: RequestError) -> str:
    return json.dumps(exc.body())


def _error(exc: RequestError) -> dict[str, Any]:
    """The ``error`` object of the OpenAI-style body."""
    error = exc.body()["error"]
    assert isinstance(error, dict)
    return error


# ---- keys ---------------------------------------------------------------------------


def test_hash_key_is_hex_sha256_and_new_keys_are_prefixed_and_random() -> None:
    assert hash_key("abc") == hashlib.sha256(b"abc").hexdigest()
    a, b = new_key(), new_key()
    assert a.startswith("kvt-") and b.startswith("kvt-") and a != b
    assert len(a) >= 4 + 43  # 32 random bytes, URL-safe base64


@pytest.mark.parametrize(
    ("header", "says"),
    [
        (None, "missing API key"),
        ("", "missing API key"),
        (f"Basic {KEY_A}", "malformed Authorization header"),
        (KEY_A, "malformed Authorization header"),  # no scheme
        ("Bearer", "malformed Authorization header"),
        (f"Bearer {KEY_A} extra", "malformed Authorization header"),
        ("Bearer kvt-not-a-configured-key", "invalid API key"),
        (f"Bearer {KEY_A}x", "invalid API key"),
    ],
)
def test_missing_malformed_or_wrong_key_is_401_that_says_how_and_never_echoes(
    header: str | None, says: str
) -> None:
    auth = Authenticator(_keys())
    with pytest.raises(AuthenticationFailed) as err:
        auth.authenticate(header)
    exc = err.value
    assert exc.status_code == 401
    assert _error(exc) == {
        "message": exc.message,
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
    assert exc.message.startswith(says)
    assert "Authorization: Bearer <key>" in exc.message and "server.api_keys" in exc.message
    assert exc.headers() == {"WWW-Authenticate": 'Bearer realm="kvtide"'}
    # Nothing the client presented comes back, not even part of it.
    text = _error_json(exc) + str(exc) + repr(exc)
    for secret in ("kvt-not-a-configured-key", KEY_A, "alpha-secret", "kvt-"):
        assert secret not in text


def test_right_key_gives_its_principal_with_its_limits() -> None:
    auth = Authenticator(_keys())
    assert auth.requires_key
    a = auth.authenticate(f"Bearer {KEY_A}")
    assert a == Principal(name="team-a", max_tokens=256, max_sessions=1000)
    # The scheme is case-insensitive (RFC 7235) and surrounding spaces are tolerated.
    b = auth.authenticate(f"  bearer   {KEY_B} ")
    assert (b.name, b.max_prompt_tokens, b.max_tokens, b.max_concurrent_requests) == (
        "team-b",
        1000,
        128,
        2,
    )
    assert not a.is_anonymous and not b.is_anonymous


def test_without_keys_every_request_is_anonymous_whatever_it_sends() -> None:
    auth = Authenticator(())
    assert not auth.requires_key
    # The openai SDK always sends a header (api_key="unused" in the README).
    for header in (None, "Bearer unused", "garbage"):
        assert auth.authenticate(header) is ANONYMOUS
    assert ANONYMOUS.is_anonymous


# ---- session ownership --------------------------------------------------------------


def test_another_keys_session_is_404_identical_to_an_unknown_one() -> None:
    a, b = Principal(name="team-a"), Principal(name="team-b")
    owners = SessionOwners(idle_ttl_s=600, max_sessions=100)
    assert owners.claim("s1", a, now_s=0.0) == ()
    owners.claim("s1", a, now_s=1.0)  # the owner runs another turn: fine
    owners.check("s1", a, now_s=2.0)
    owners.check("never-seen", b, now_s=2.0)  # unclaimed: not this object's business

    with pytest.raises(SessionNotFound) as err:
        owners.claim("s1", b, now_s=3.0)
    assert err.value.status_code == 404
    with pytest.raises(SessionNotFound) as err2:
        owners.check("s1", b, now_s=3.0)
    # What team-b sees for team-a's session is byte for byte what a truly unknown
    # session gives (with the same id): it learns nothing.
    unknown = session_not_found("s1")
    assert _error_json(err.value) == _error_json(err2.value) == _error_json(unknown)
    assert _error(err.value)["code"] == "session_not_found"
    assert "team-a" not in _error_json(err.value)
    # The refused claim took nothing over.
    assert owners.owner("s1", now_s=3.0) == "team-a"

    # Closed: anyone may start a new session with that id.
    owners.forget("s1")
    owners.claim("s1", b, now_s=4.0)
    assert owners.owner("s1", now_s=4.0) == "team-b"


def test_ownership_expires_after_the_idle_ttl_and_the_caller_is_told_to_close() -> None:
    a, b = Principal(name="team-a"), Principal(name="team-b")
    owners = SessionOwners(idle_ttl_s=100, max_sessions=100)
    owners.claim("s1", a, now_s=0.0)
    owners.claim("s2", a, now_s=50.0)
    owners.claim("s1", a, now_s=60.0)  # a turn on s1 refreshes its idle clock

    # t=149: s2 idle 99 s, s1 idle 89 s: both still owned.
    assert owners.expire(now_s=149.0) == ()
    with pytest.raises(SessionNotFound):
        owners.check("s2", b, now_s=149.0)
    # t=150: s2 idle 100 s: expired (even before expire() runs, a query sees it gone).
    assert owners.owner("s2", now_s=150.0) is None
    owners.check("s2", b, now_s=150.0)
    assert owners.expire(now_s=150.0) == ("s2",)
    assert len(owners) == 1
    # A claim expires idle entries on its way and returns them too.
    assert owners.claim("s3", b, now_s=160.0) == ("s1",)
    assert len(owners) == 1 and owners.owner("s3", now_s=160.0) == "team-b"


def test_another_key_claiming_an_expired_session_is_told_to_close_its_old_state() -> None:
    a, b = Principal(name="team-a"), Principal(name="team-b")
    owners = SessionOwners(idle_ttl_s=100, max_sessions=100)
    owners.claim("s1", a, now_s=0.0)
    owners.touch("s1", a, now_s=30.0)  # team-a's turn ended at t=30: idle from there
    owners.touch("s1", b, now_s=60.0)  # not b's session: no effect, no error
    with pytest.raises(SessionNotFound):
        owners.claim("s1", b, now_s=129.0)
    # t=130: expired but not yet swept by expire(). team-b may take the id, and is told
    # to close s1 first so that none of team-a's KV or tokens carry over.
    assert owners.claim("s1", b, now_s=130.0) == ("s1",)
    assert owners.owner("s1", now_s=130.0) == "team-b"
    # The owner coming back to its own expired session has nothing to close.
    assert owners.claim("s1", b, now_s=500.0) == ()


def test_a_key_over_its_session_quota_is_refused_and_no_other_session_is_closed() -> None:
    a = Principal(name="team-a", max_sessions=2)
    b = Principal(name="team-b", max_sessions=2)
    owners = SessionOwners(idle_ttl_s=1000, max_sessions=3)
    assert owners.claim("a1", a, now_s=0.0) == ()
    assert owners.claim("a2", a, now_s=1.0) == ()
    with pytest.raises(LimitExceeded) as quota:
        owners.claim("a3", a, now_s=2.0)  # team-a's third session: its own quota
    assert quota.value.code == "session_limit_exceeded" and "team-a" in quota.value.message
    assert owners.claim("a1", a, now_s=3.0) == ()  # its existing sessions still run
    assert owners.claim("b1", b, now_s=4.0) == ()
    with pytest.raises(LimitExceeded) as full:
        owners.claim("b2", b, now_s=5.0)  # the book is full: refused, nobody evicted
    assert full.value.code == "session_capacity_exceeded" and full.value.headers()["Retry-After"]
    assert [owners.owner(s, 5.0) for s in ("a1", "a2", "b1")] == ["team-a", "team-a", "team-b"]
    owners.forget("a2")
    assert owners.claim("a3", a, now_s=6.0) == ()  # a closed session frees its place


def test_a_running_turn_keeps_its_session_owned_past_the_idle_ttl() -> None:
    a = Principal(name="team-a")
    owners = SessionOwners(idle_ttl_s=100, max_sessions=10)
    owners.claim("s1", a, now_s=0.0)
    owners.claim("s2", a, now_s=0.0)
    # 150 s later s1's turn is still running; s2 is idle.
    assert owners.expire(150.0, keep=["s1"]) == ("s2",)
    assert owners.owner("s1", 150.0) == "team-a"
    owners.touch("s1", a, now_s=200.0)  # the turn ended: the idle clock restarts
    assert owners.expire(299.0) == ()
    assert owners.expire(300.0) == ("s1",)


def test_anonymous_principal_records_no_owners() -> None:
    owners = SessionOwners(idle_ttl_s=10, max_sessions=1)
    assert owners.claim("s1", ANONYMOUS, now_s=0.0) == ()
    owners.check("s1", ANONYMOUS, now_s=0.0)
    assert len(owners) == 0


def test_session_owners_rejects_unbounded_settings() -> None:
    with pytest.raises(ValueError, match="max_sessions"):
        SessionOwners(idle_ttl_s=10, max_sessions=0)
    with pytest.raises(ValueError, match="idle_ttl_s"):
        SessionOwners(idle_ttl_s=0, max_sessions=10)


# ---- limits -------------------------------------------------------------------------


def test_request_over_a_key_limit_is_429_naming_the_limit_and_the_value() -> None:
    b = Principal(name="team-b", max_prompt_tokens=1000, max_tokens=128)
    check_request(b, num_prompt_tokens=1000, max_tokens=128)  # at the limits: fine
    check_request(b, num_prompt_tokens=10, max_tokens=None)  # unspecified: capped, not refused
    assert b.cap_max_tokens(4096) == 128 and b.cap_max_tokens(16) == 16

    with pytest.raises(LimitExceeded) as err:
        check_request(b, num_prompt_tokens=1001, max_tokens=16, prompt_param="prompt")
    body = _error(err.value)
    assert err.value.status_code == 429
    assert (body["type"], body["code"], body["param"]) == (
        "rate_limit_error",
        "prompt_too_long_for_key",
        "prompt",
    )
    assert "1001" in body["message"] and "1000" in body["message"]
    assert "max_prompt_tokens" in body["message"] and "team-b" in body["message"]
    assert err.value.headers() == {}  # waiting does not help

    with pytest.raises(LimitExceeded) as err:
        check_request(b, num_prompt_tokens=10, max_tokens=129)
    body = _error(err.value)
    assert (body["code"], body["param"]) == ("max_tokens_over_key_limit", "max_tokens")
    assert "129" in body["message"] and "128" in body["message"]

    # No limits on the key (or no keys at all): nothing is refused or capped.
    check_request(ANONYMOUS, num_prompt_tokens=10**6, max_tokens=10**6)
    assert ANONYMOUS.cap_max_tokens(4096) == 4096


def test_concurrency_gate_counts_exactly_and_refusals_leave_nothing_behind() -> None:
    b = Principal(name="team-b", max_concurrent_requests=2)
    a = Principal(name="team-a")  # no concurrency limit
    gate = ConcurrencyGate(retry_after_s=2.5)

    t1, t2 = gate.acquire(b), gate.acquire(b)
    assert gate.num_in_flight(b) == 2 and not gate.can_acquire(b)
    # The third is refused with 429, a Retry-After hint, and no count change.
    for _ in range(3):
        with pytest.raises(LimitExceeded) as err:
            gate.acquire(b)
        assert gate.num_in_flight(b) == 2
    body = _error(err.value)
    assert (err.value.status_code, body["code"]) == (429, "concurrency_limit_exceeded")
    assert "max_concurrent_requests" in body["message"] and "2" in body["message"]
    assert err.value.retry_after_s == 2.5 and err.value.headers() == {"Retry-After": "3"}
    # Other keys are counted apart and not limited by team-b's limit.
    ta = [gate.acquire(a) for _ in range(5)]
    assert gate.num_in_flight(a) == 5 and gate.num_in_flight(b) == 2

    # Releasing is exact and idempotent: a second release of t1 does not free t2's slot.
    gate.release(t1)
    gate.release(t1)
    assert gate.num_in_flight(b) == 1
    t3 = gate.acquire(b)
    assert gate.num_in_flight(b) == 2 and not gate.can_acquire(b)
    # A ticket from another gate never releases one of this gate's.
    other = ConcurrencyGate()
    gate.release(other.acquire(b))
    assert gate.num_in_flight(b) == 2
    for t in (t2, t3, *ta):
        gate.release(t)
    assert gate.num_in_flight(a) == gate.num_in_flight(b) == 0
    assert gate._live == {}  # no per-key state left once nothing is in flight


def test_admitted_releases_on_error_and_a_refused_entry_releases_nothing() -> None:
    b = Principal(name="team-b", max_concurrent_requests=1)
    gate = ConcurrencyGate()
    with pytest.raises(RuntimeError), gate.admitted(b):
        assert gate.num_in_flight(b) == 1
        with pytest.raises(LimitExceeded), gate.admitted(b):
            pass
        assert gate.num_in_flight(b) == 1  # the refused entry did not release ours
        raise RuntimeError("the request failed")
    assert gate.num_in_flight(b) == 0


def test_new_request_errors_map_to_openai_bodies() -> None:
    busy = TurnInProgress("session 's1' has a turn running; retry when it has finished")
    assert _error(busy)["code"] == "turn_in_progress"
    assert TurnInProgress("x").status_code == 409
    assert SessionNotFound("x").status_code == 404


# ---- config -------------------------------------------------------------------------


def _key_entry(name: str = "team-a", key: str = KEY_A, **limits: int) -> dict[str, object]:
    return {"name": name, "sha256": hash_key(key), **limits}


def test_api_keys_convert_to_frozen_core_config() -> None:
    cfg = parse_config(
        {
            "server": {
                "host": "0.0.0.0",
                "api_keys": [
                    _key_entry(max_tokens=256),
                    _key_entry("team-b", KEY_B, max_concurrent_requests=2),
                ],
            }
        }
    )
    assert cfg.server.requires_api_key
    assert cfg.server.api_keys == (
        _keys()[0],
        ApiKeyConfig(name="team-b", sha256=hash_key(KEY_B), max_concurrent_requests=2),
    )
    assert isinstance(cfg.server.api_keys, tuple)
    auth = Authenticator(cfg.server.api_keys)
    assert auth.authenticate(f"Bearer {KEY_B}").max_concurrent_requests == 2
    # The default: no keys, loopback API and dashboard.
    default = parse_config(None).server
    assert (default.api_keys, default.allow_unauthenticated) == ((), False)
    assert (default.host, default.dashboard_host) == ("127.0.0.1", "127.0.0.1")


@pytest.mark.parametrize(
    ("sha256", "hint"),
    [
        ("ab" * 31, "got 62 characters"),
        (hash_key(KEY_A).upper(), "lowercase"),
        ("z" * 64, "hex"),
        (KEY_A, "looks like a key"),
    ],
)
def test_bad_hash_is_a_config_error_naming_the_field_without_echoing_it(
    sha256: str, hint: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"server": {"api_keys": [{"name": "team-a", "sha256": sha256}]}})
    assert err.value.field == "server.api_keys.0.sha256"
    assert hint in str(err.value) and "kvtide key new" in str(err.value)
    assert sha256 not in str(err.value)


def test_duplicate_key_names_or_hashes_are_config_errors() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"server": {"api_keys": [_key_entry(), _key_entry(key=KEY_B)]}})
    assert err.value.field == "server.api_keys"
    assert "'team-a' appears twice" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse_config({"server": {"api_keys": [_key_entry(), _key_entry("team-b")]}})
    assert err.value.field == "server.api_keys" and "same sha256" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse_config({"server": {"api_keys": [_key_entry("(anonymous)")]}})
    assert err.value.field == "server.api_keys.0.name"
    with pytest.raises(ConfigError) as err:
        parse_config({"server": {"api_keys": [_key_entry(max_concurrent_requests=0)]}})
    assert err.value.field == "server.api_keys.0.max_concurrent_requests"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_hosts_need_no_keys(host: str) -> None:
    assert parse_config({"server": {"host": host}}).server.host == host


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "my-host.internal"])
def test_non_loopback_host_without_keys_needs_allow_unauthenticated(host: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"server": {"host": host}})
    assert err.value.field == "server.host"
    message = str(err.value)
    assert repr(host) in message and "server.api_keys" in message
    assert "server.allow_unauthenticated: true" in message and "kvtide key new" in message

    opened = parse_config({"server": {"host": host, "allow_unauthenticated": True}})
    assert opened.server.allow_unauthenticated and not opened.server.requires_api_key
    keyed = parse_config({"server": {"host": host, "api_keys": [_key_entry()]}})
    assert keyed.server.requires_api_key


def test_non_loopback_dashboard_needs_allow_unauthenticated_even_with_keys() -> None:
    server = {"host": "0.0.0.0", "api_keys": [_key_entry()], "dashboard_host": "0.0.0.0"}
    with pytest.raises(ConfigError) as err:
        parse_config({"server": server})
    assert err.value.field == "server.dashboard_host" and "job API" in str(err.value)
    cfg = parse_config({"server": {**server, "allow_unauthenticated": True}})
    assert cfg.server.dashboard_host == "0.0.0.0"


# ---- CLI ----------------------------------------------------------------------------


def test_cli_key_new_prints_a_key_whose_hash_is_in_the_config_snippet(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["key", "new", "--name", "team-a"]) == 0
    out = capsys.readouterr().out
    [key] = re.findall(r"^\s+(kvt-\S+)$", out, flags=re.MULTILINE)
    snippet = yaml.safe_load(out[out.index("server:") :])
    assert snippet == {"server": {"api_keys": [{"name": "team-a", "sha256": hash_key(key)}]}}
    assert out.count(key) == 1  # shown once
    # The snippet is a valid config that accepts exactly that key.
    cfg = parse_config(snippet)
    assert Authenticator(cfg.server.api_keys).authenticate(f"Bearer {key}").name == "team-a"

    # Without --name the name comes from the hash; every call makes a new key.
    assert main(["key", "new"]) == 0
    out2 = capsys.readouterr().out
    [key2] = re.findall(r"^\s+(kvt-\S+)$", out2, flags=re.MULTILINE)
    assert key2 != key and f"name: key-{hash_key(key2)[:8]}" in out2

    # --operator: the entry makes an operator's key.
    assert main(["key", "new", "--name", "ops", "--operator"]) == 0
    out3 = capsys.readouterr().out
    [key3] = re.findall(r"^\s+(kvt-\S+)$", out3, flags=re.MULTILINE)
    cfg = parse_config(yaml.safe_load(out3[out3.index("server:") :]))
    assert Authenticator(cfg.server.api_keys).authenticate(f"Bearer {key3}").may_operate


def test_cli_key_new_refuses_a_bad_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["key", "new", "--name", "bad name"]) == 2
    captured = capsys.readouterr()
    assert "server.api_keys.0.name" in captured.err and "kvt-" not in captured.out
