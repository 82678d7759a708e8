"""``kvtide integrity`` against a fake server (``httpx.MockTransport``): the pairs an
integrity check turned off, and an operator turning one back on."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest

from orchestrator.cli.integrity import add_integrity_parser, cmd_integrity

URL = "http://kvtide.test:8000"
PAIR = {
    "prefill_engine_id": "prefill-a",
    "source_engine_id": "decode-b",
    "decode_engine_id": "decode-c",
    "session_id": "s1",
    "request_id": "r7",
    "num_tokens": 4,
    "max_abs_diff": 0.3145,
    "tolerance": 0.1,
}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_integrity_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["integrity", *argv, "--url", URL])


def _run(
    capsys: pytest.CaptureFixture[str], status: int, body: object, *argv: str
) -> tuple[int, str, str, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(status, json=body)

    code = cmd_integrity(_args(*argv), transport=httpx.MockTransport(handle))
    out = capsys.readouterr()
    return code, out.out, out.err, seen


def test_list_names_each_pair_and_the_mismatch(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err, seen = _run(capsys, 200, {"kv": {"reuse_off": [PAIR]}}, "list")
    assert (code, err) == (0, "")
    assert seen[0].method == "GET" and seen[0].url.path == "/kvtide/stats"
    assert out == (
        "reuse off (an integrity check failed), prefill <- source:\n"
        "  prefill-a <- decode-b: turn r7 of session s1, decoded on decode-c, log "
        "probabilities off by up to 0.3145 (tolerance 0.1)\n"
    )
    code, out, _, _ = _run(capsys, 200, {"kv": {"reuse_off": []}}, "list")
    assert out == "reuse is on for every engine pair (no integrity check has failed)\n"


def test_reuse_on_posts_the_pair(capsys: pytest.CaptureFixture[str]) -> None:
    answer = {"prefill_engine_id": "prefill-a", "source_engine_id": "decode-b", "reuse": "on"}
    argv = ("reuse-on", "--prefill", "prefill-a", "--source", "decode-b")
    code, out, err, seen = _run(capsys, 200, answer, *argv)
    assert (code, err) == (0, "")
    assert seen[0].method == "POST" and seen[0].url.path == "/kvtide/integrity/reuse"
    assert json.loads(seen[0].content) == {
        "prefill_engine_id": "prefill-a",
        "source_engine_id": "decode-b",
    }
    assert out == "reuse is on again from decode-b into prefill-a\n"


def test_a_pair_that_is_not_off_is_the_servers_404(capsys: pytest.CaptureFixture[str]) -> None:
    body = {"error": {"message": "reuse is not off for prefill engine 'p'", "code": "not_found"}}
    code, out, err, _ = _run(capsys, 404, body, "reuse-on", "--prefill", "p", "--source", "d")
    assert (code, out) == (1, "")
    assert err == (
        "kvtide: POST /kvtide/integrity/reuse: HTTP 404: reuse is not off for prefill "
        "engine 'p' (not_found)\n"
    )
