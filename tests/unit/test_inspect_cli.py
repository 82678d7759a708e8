"""``kvtide inspect`` against a fake server (``httpx.MockTransport``) and fake Ray nodes.

Each test plays one operator question: the answer the server gives, what the command
prints, and its exit code. Failures must be one ``kvtide:`` line on stderr, never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import socket
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from orchestrator.cli.inspect import (
    add_inspect_parser,
    cmd_inspect,
    format_domains,
    format_engine_groups,
    format_session,
    format_stats,
)
from orchestrator.cli.main import main
from orchestrator.cluster.ray_nodes import RayNode

URL = "http://kvtide.test:8000"
MIB = 2**20

# What GET /kvtide/stats answers, in the server's shapes: recomputes_by_reason is the
# policy's tuple of (reason, count) pairs, sent as lists; engines are EngineStats.
STATS: dict[str, Any] = {
    "kv": {
        "num_sessions": 7,
        "num_records": 5,
        "num_pulls": 12,
        "num_declines": 1,
        "num_expiries": 2,
        "num_evictions": 3,
        "num_releases": 9,
        "recomputes_by_reason": [
            ["no_record", 7],
            ["pull_in_flight", 0],
            ["expired", 2],
            ["within_margin", 0],
            ["prefix_mismatch", 1],
            ["below_threshold", 0],
            ["cheaper_to_recompute", 0],
            ["evicted", 3],
            ["failed_pull", 1],
        ],
        "bytes_held": {"decode-b": 0, "decode-a": int(4.5 * MIB)},
        "num_drains": 11,
        "num_drain_failures": 1,
        "num_undrainable": 2,
        "service": {
            "epoch": "0123456789abcdef0123",
            "uptime_s": 3725.0,
            "restoring": False,
            "restores": 2,
            "adopted": 4,
            "adopt_skipped_consumed": 1,
            "adopt_superseded": 0,
        },
    },
    "engines": {
        "prefill": {
            "engine_id": "prefill-0",
            "num_running": 1,
            "num_waiting": 0,
            "kv_cache_usage": 0.125,
            "num_prompt_tokens": 5000,
            "num_generation_tokens": 12,
            "num_prefix_cache_queries": 5000,
            "num_prefix_cache_hits": 3000,
            "kv_transfer_bytes": 12 * MIB,
            "num_kv_transfers": 6,
            "num_kv_transfer_failures": 1,
            "num_kv_expired_reads": 2,
        },
        "decode": {"engine_id": "decode-a", "kv_cache_usage": 0.375},
    },
    "metrics": {
        "kvtide_kv_send_backs_total": 11.0,
        'kvtide_ttft_seconds_count{pool="decode"}': 4.0,
        'kvtide_ttft_seconds_sum{pool="decode"}': 2.0,
    },
}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvtide")
    add_inspect_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["inspect", *argv])


def _server(status: int, body: Any, seen: list[httpx.Request] | None = None) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)

    return httpx.MockTransport(handle)


def _error(message: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "x", "param": None, "code": code}}


Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Run:
    def go(transport: httpx.BaseTransport, *argv: str) -> tuple[int, str, str]:
        code = cmd_inspect(_args(*argv), transport=transport)
        out = capsys.readouterr()
        return code, out.out, out.err

    return go


# ---- stats ----------------------------------------------------------------------------


def test_stats_summary_names_every_counter_an_operator_reads() -> None:
    text = format_stats(STATS)
    # the service: epoch (short), uptime, the last rebuild
    assert "epoch 0123456789ab, up 1 h 02 min" in text
    assert "restores 2: adopted 4, skipped as already read 1, superseded 0" in text
    # the policy: pulls against recomputes, and why each recompute happened (non-zero only)
    assert "turns: pulls 12, recomputes 14" in text
    assert "recomputes by reason: no_record 7, expired 2, prefix_mismatch 1, evicted 3, " in text
    assert "failed_pull 1" in text and "within_margin" not in text
    assert "failed or declined pulls 1, expiries 2, evictions 3, releases 9" in text
    assert "drains 11, drain failures 1, undrainable 2" in text
    # bytes held per decode engine, sorted
    assert "    decode-a: 4.5 MiB\n    decode-b: 0 B" in text
    # the engines' own counters, per pool
    assert "prefill: prefill-0: running 1, waiting 0, KV cache usage 12.5%" in text
    assert "prefix cache hits 3,000 of 5,000" in text
    assert "KV transfers 6 (12.0 MiB), failures 1, expired reads 2" in text
    assert "decode: decode-a: running 0, waiting 0, KV cache usage 37.5%" in text
    # the metrics, with the histogram's mean
    assert "kvtide_kv_send_backs_total 11" in text
    assert 'mean kvtide_ttft_seconds{pool="decode"}: 0.500 s over 4' in text


def test_stats_counts_the_pairs_whose_reuse_is_off() -> None:
    text = format_stats({"kv": {"reuse_off": [{"prefill_engine_id": "p"}]}})
    assert "engine pairs with reuse off (an integrity check failed): 1" in text


def test_stats_accepts_reasons_as_a_mapping_and_missing_sections() -> None:
    text = format_stats({"kv": {"recomputes_by_reason": {"expired": 3}}})
    assert "recomputes by reason: expired 3" in text
    assert "KV bytes held for idle sessions, per engine (a host tier's store among them):\n" in text
    assert "none reported" in text
    assert "  host tier:" not in text  # an app without one


def test_stats_shows_the_host_tier() -> None:
    kv = {
        "num_host_take_ins": 5,
        "num_host_take_in_failures": 1,
        "num_host_unbooked": 0,
        "num_host_releases": 2,
        "host_tier": {
            "num_stores": 2,
            "num_entries": 3,
            "num_free_blocks": 40,
            "bytes_taken_in": 3 * 2**20,
        },
    }
    text = format_stats({"kv": kv})
    assert (
        "host tier: sessions taken in 5 (failed 1, not booked 0), released 2; 2 stores (one "
        "per node) hold 3, 40 blocks free, 3.0 MiB taken in since they started"
    ) in text
    assert "host tier: store not reachable (TimeoutError)" in format_stats(
        {"kv": {"host_tier": {"unreachable": "TimeoutError"}}}
    )


def test_stats_prints_the_summary_or_the_raw_json(run: Run) -> None:
    seen: list[httpx.Request] = []
    code, out, err = run(_server(200, STATS, seen), "stats", "--url", URL)
    assert (code, err) == (0, "")
    assert "recomputes by reason: no_record 7" in out
    assert seen[0].url == httpx.URL(URL + "/kvtide/stats")

    code, out, _ = run(_server(200, STATS), "stats", "--json", "--url", URL)
    assert code == 0 and json.loads(out) == STATS


# ---- health and errors ----------------------------------------------------------------


def test_health_ok_exits_0(run: Run) -> None:
    code, out, err = run(_server(200, {"status": "ok"}), "health", "--url", URL)
    assert (code, err) == (0, "")
    assert out == f"ok: kvtide at {URL} is healthy (every pool's engine answered)\n"


def test_unhealthy_engines_exit_1_with_the_servers_message(run: Run) -> None:
    body = _error("engines not ready: TimeoutError: ", "engine_unavailable")
    code, out, err = run(_server(503, body), "health", "--url", URL)
    assert (code, out) == (1, "")
    assert err == (
        "kvtide: GET /health: HTTP 503: engines not ready: TimeoutError:  (engine_unavailable)\n"
    )


def test_an_unknown_session_is_a_404_message_not_a_traceback(run: Run) -> None:
    message = "session 's1' not found: it does not exist, has expired or was closed"
    code, out, err = run(_server(404, _error(message, "session_not_found")), "session", "s1")
    assert (code, out) == (1, "")
    assert err == f"kvtide: GET /kvtide/sessions/s1: HTTP 404: {message} (session_not_found)\n"
    assert "Traceback" not in err


def test_a_wrong_key_gets_401_and_the_key_is_sent_as_a_bearer_token(run: Run) -> None:
    seen: list[httpx.Request] = []
    body = _error("invalid API key: send 'Authorization: Bearer <key>'", "invalid_api_key")
    code, _, err = run(_server(401, body, seen), "stats", "--url", URL, "--api-key", "kvt-x")
    assert code == 1
    assert "HTTP 401: invalid API key" in err and "kvt-x" not in err
    assert seen[0].headers["authorization"] == "Bearer kvt-x"


def test_other_error_bodies_are_shown_too(run: Run) -> None:
    code, _, err = run(_server(404, {"detail": "Not Found"}), "stats", "--url", URL)
    assert (code, err) == (1, "kvtide: GET /kvtide/stats: HTTP 404: Not Found\n")
    code, _, err = run(_server(502, "Bad Gateway"), "stats", "--url", URL)
    assert (code, err) == (1, "kvtide: GET /kvtide/stats: HTTP 502: Bad Gateway\n")
    code, _, err = run(_server(200, "<html>"), "stats", "--url", URL)
    assert (code, err) == (1, "kvtide: GET /kvtide/stats: the answer is not JSON: '<html>'\n")


def test_an_unreachable_server_exits_1_and_says_where_it_looked(run: Run) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    code, _, err = run(httpx.MockTransport(refuse), "health", "--url", URL + "/v1/")
    assert code == 1
    assert err.startswith(f"kvtide: cannot reach kvtide at {URL}: ConnectError: [Errno 111]")
    assert "set --url or $KVTIDE_URL" in err


def test_url_and_key_default_to_the_environment(monkeypatch: pytest.MonkeyPatch, run: Run) -> None:
    monkeypatch.setenv("KVTIDE_URL", URL + "/v1")
    monkeypatch.setenv("KVTIDE_API_KEY", "kvt-env")
    seen: list[httpx.Request] = []
    code, _, _ = run(_server(200, {"id": "a/b"}, seen), "session", "a/b")
    assert code == 0
    # the id is one path segment, whatever it holds
    assert str(seen[0].url) == URL + "/kvtide/sessions/a%2Fb"
    assert seen[0].headers["authorization"] == "Bearer kvt-env"


def test_the_kvtide_command_runs_inspect(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["inspect", "health", "--url", f"http://127.0.0.1:{port}"]) == 1
    assert capsys.readouterr().err.startswith(
        f"kvtide: cannot reach kvtide at http://127.0.0.1:{port}"
    )


# ---- sessions -------------------------------------------------------------------------


def test_session_with_kv_held() -> None:
    body = {
        "id": "s1",
        "object": "session",
        "record": {
            "engine_id": "decode-a",
            "num_tokens": 1564,
            "bytes_held": 6 * MIB,
            "expires_in_s": 31.25,
        },
        "lease_expires_in_s": 475.0,
    }
    assert format_session(body) == (
        "session s1\n"
        "  KV: 1,564 tokens (6.0 MiB) on decode engine decode-a; the engine frees it in "
        "31.2 s, and kvtide offers it for pulls until kv.safety_margin_s before that\n"
        "  lease: 7 min 55 s left (each turn and each POST /kvtide/sessions/s1/renew "
        "extends it)"
    )


def test_session_known_without_kv_and_unknown_session() -> None:
    known = format_session({"id": "s2", "record": None, "lease_expires_in_s": 12.0})
    assert "KV: none offered now" in known and "lease: 12.0 s left" in known
    unknown = format_session({"id": "s3", "record": None, "lease_expires_in_s": None})
    assert unknown.startswith("session s3: kvtide does not know it")


# ---- domains --------------------------------------------------------------------------


def _node(node_id: str, gpus: int, domain: str | None = None, alive: bool = True) -> RayNode:
    return RayNode(
        node_id=node_id,
        alive=alive,
        domain_id=domain or node_id,
        labelled=domain is not None,
        num_gpus=gpus,
        num_cpus=8.0,
    )


def test_domains_lists_each_domain_its_nodes_and_free_gpus() -> None:
    nodes = [
        _node("head", 0),  # CPU only, no label
        _node("tray-1", 4, "nvl72-a"),
        _node("tray-0", 4, "nvl72-a"),
        _node("hgx", 8),  # GPUs but no label: its own domain
        _node("tray-2", 4, "nvl72-a", alive=False),
    ]
    free = {"tray-0": 4, "tray-1": 1, "hgx": 8, "head": 0}
    assert format_domains(nodes, free, address="10.0.0.1:6379").splitlines() == [
        "Ray at 10.0.0.1:6379: 4 alive nodes, 3 with GPUs",
        "NVLink domains (an engine's shards never span two):",
        "  hgx: 1 node, 8 GPUs, 8 free, largest free node 8 "
        "(no nvlink_domain label: one node, its own domain)",
        "    node hgx: 8 GPUs (8 free), 8 CPUs",
        "  nvl72-a: 2 nodes, 8 GPUs, 5 free, largest free node 4",
        "    node tray-0: 4 GPUs (4 free), 8 CPUs",
        "    node tray-1: 4 GPUs (1 free), 8 CPUs",
        "Nodes without an nvlink_domain label:",
        "  head: 8 CPUs, no GPUs: left out of engine placement",
        "  hgx: 8 CPUs, 8 GPUs, its own domain: no engine spans it and another node "
        "(label nodes that share an NVLink fabric nvlink_domain=<id>)",
        "Dead nodes (their engines' shards are gone):",
        "  tray-2: nvlink_domain=nvl72-a",
    ]


def test_domains_on_a_cluster_without_gpus_says_so() -> None:
    text = format_domains([_node("cpu-0", 0)], {}, address="127.0.0.1:6379")
    assert "Ray reports no alive node with GPUs" in text
    assert "ray start --num-gpus=N --labels nvlink_domain=<domain id>" in text


def test_domains_without_a_cluster_exits_1(run: Run) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out, err = run(_server(200, {}), "domains", "--address", f"127.0.0.1:{port}")
    assert (code, out) == (1, "")
    assert err.startswith(f"kvtide: cannot connect to Ray at '127.0.0.1:{port}'")
    assert "set $RAY_ADDRESS" in err


def test_domains_lists_each_engine_group_where_its_gpus_are() -> None:
    nodes = [
        _node("a0", 4, "nvl72-a"),
        _node("a1", 4, "nvl72-a", alive=False),
        _node("h1", 8, "hgx-1"),
    ]
    gpu = {"GPU": 1.0, "CPU": 1.0}
    table = {
        "g1": {
            "name": "SERVE_REPLICA::kvtide#decode-pool-nvl72-a#r1",
            "state": "RESCHEDULING",
            "bundles": {0: {"CPU": 1.0}, 1: gpu, 2: gpu, 3: gpu},
            "bundles_to_node_id": {0: "a0", 1: "a0", 2: "a0", 3: "a1"},
        },
        "g2": {
            "name": "SERVE_REPLICA::kvtide#prefill-pool-hgx-1#r2",
            "state": "CREATED",
            "bundles": {0: gpu},
            "bundles_to_node_id": {0: "h1"},
        },
        "g3": {
            "name": "SERVE_REPLICA::kvtide#decode-pool-nvl72-b#r3",
            "state": "PENDING",
            "bundles": {0: {"CPU": 1.0}, 1: gpu},
            "bundles_to_node_id": {},
        },
        "g4": {"name": "SERVE_REPLICA::kvtide#ingress#r4", "state": "CREATED", "bundles": {}},
        "g5": {"name": "other", "state": "CREATED", "bundles": {0: gpu}},
    }
    assert format_engine_groups(table, nodes).splitlines() == [
        "Engine placement groups (Serve replicas; GPUs by domain/node):",
        "  kvtide/decode-pool-nvl72-a replica r1: 3 GPUs, RESCHEDULING; "
        "nvl72-a/a0: 2, nvl72-a/a1 (dead): 1",
        "  kvtide/decode-pool-nvl72-b replica r3: 1 GPUs, PENDING; unplaced: 1",
        "  kvtide/prefill-pool-hgx-1 replica r2: 1 GPUs, CREATED; hgx-1/h1: 1",
    ]
    assert format_engine_groups({}, nodes) == ""
