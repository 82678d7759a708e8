"""kvtide against vLLM's own OpenAI server, request by request: the same corpus
(``corpus.py``: chat and completions, tools with tool_choice required/named/none/auto,
json_object and json_schema, logprobs, ``n``, stop strings, seeds, penalties, logit
bias, streamed and not, multi-turn conversations with tool results, sessions on and
off, invalid requests) sent to ``vllm serve`` on the same tiny model (one engine, fp32,
greedy or seeded) and to kvtide (P/D, sessions, KV sent back), compared field by field.

Every difference fails the suite unless it is one of ``ALLOWED``, each with its reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from corpus import Case, corpus

from benchmarks.common import vllm_server as serve_vllm

pytestmark = pytest.mark.engine

LOGPROB_TOLERANCE = 1e-3
"""fp32 on CPU: the same tokens' log probabilities from a batch of another shape (P/D
engines vs one engine) differ in the last bits; tokens must be equal."""

ALLOWED = {
    "id, created, system_fingerprint": "generated per request by each server",
    "tool call ids": "random per call (chatcmpl-tool-...)",
    "the kvtide object": "kvtide's extension: the turn's KV facts",
    "usage.prompt_tokens_details.cached_tokens": "KV reuse differs by design: sent back "
    "from decode or the prefill's prefix cache (kvtide) vs one engine's prefix cache",
    "error messages of kvtide's own layer": "a request kvtide's own layer serves (plain "
    "text fields) is refused in kvtide's words, with the same status",
    "logprob values within 1e-3": "fp32 numerics of different batch shapes",
    "a later turn's prompt tokens, and so its answer, where the prompt text is the same": (
        "token continuity: kvtide continues a conversation from the exact token ids the "
        "decode engine produced (what its kept KV holds), vLLM re-tokenizes the rendered "
        "history; where a random model's tokens are not the tokenizer's own split of their "
        "text, the ids differ while the text is equal (checked: both prompts' ids decode "
        "to the same text), and the conversations part from there"
    ),
    "tool calls sent back with the ids kvtide returned": "kvtide renders them as the "
    "model wrote them (tool turns keep their KV, docs/api.md), vLLM through the chat "
    "template; the runner here sends its own ids, so both render through the template",
}


@pytest.fixture(scope="module")
def vllm_server(kvtide_app: Any, short_tmp: Path) -> Iterator[str]:
    """``vllm serve`` on the app's model, configured as kvtide's engines and API are."""
    with serve_vllm(
        kvtide_app.model_path,
        kvtide_app.model,
        max_model_len=kvtide_app.config.model.max_model_len,
        args=[
            "--tool-call-parser",
            "hermes",
            "--enable-auto-tool-choice",
            "--enable-prompt-tokens-details",
            "--structured-outputs-config",
            json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
        ],
        # As kvtide's config for the tiny model.
        env={"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"},
        log_path=short_tmp / "vllm-serve.log",
    ) as base:
        yield base


def _send(client: httpx.Client, case: Case, body: dict[str, Any], headers: dict[str, str]) -> Any:
    path = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}[case.endpoint]
    if not body.get("stream"):
        r = client.post(path, json=body, headers=headers)
        return {"status": r.status_code, "body": r.json()}
    with client.stream("POST", path, json=body, headers=headers) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "body": r.json()}
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return {"status": 200, "events": events}


def _assembled(answer: Any) -> dict[str, Any]:
    """A streamed answer as the client assembles it, or a full one's fields to compare."""
    if "events" not in answer:
        body = answer["body"]
        if answer["status"] != 200:
            return {"status": answer["status"]}
        choices = []
        for c in sorted(body["choices"], key=lambda c: c["index"]):
            message = c.get("message") or {}
            calls = [
                (t["function"]["name"], t["function"]["arguments"])
                for t in message.get("tool_calls") or ()
            ]
            choices.append(
                {
                    "text": message.get("content") if "message" in c else c.get("text"),
                    "tool_calls": calls,
                    "finish_reason": c["finish_reason"],
                    "logprobs": _logprobs(c.get("logprobs")),
                }
            )
        usage = body.get("usage") or {}
        return {
            "status": 200,
            "choices": choices,
            "usage": (usage.get("prompt_tokens"), usage.get("completion_tokens")),
            "prompt_token_ids": body.get("prompt_token_ids"),
            "prompt_logprobs": _prompt_logprobs(body.get("prompt_logprobs")),
        }
    by_index: dict[int, dict[str, Any]] = {}
    usage: Any = (None, None)
    for event in answer["events"]:
        if event.get("usage"):
            usage = (event["usage"].get("prompt_tokens"), event["usage"].get("completion_tokens"))
        for c in event.get("choices") or ():
            got = by_index.setdefault(c["index"], {"text": "", "calls": {}, "finish_reason": None})
            delta = c.get("delta") or {}
            got["text"] += delta.get("content") or c.get("text") or ""
            for t in delta.get("tool_calls") or ():
                call = got["calls"].setdefault(t.get("index", 0), ["", ""])
                call[0] += (t.get("function") or {}).get("name") or ""
                call[1] += (t.get("function") or {}).get("arguments") or ""
            got["finish_reason"] = c.get("finish_reason") or got["finish_reason"]
    choices = [
        {
            "text": v["text"] or None,
            "tool_calls": [tuple(v["calls"][k]) for k in sorted(v["calls"])],
            "finish_reason": v["finish_reason"],
        }
        for _, v in sorted(by_index.items())
    ]
    return {"status": 200, "choices": choices, "usage": usage}


def _prompt_logprobs(raw: Any) -> Any:
    """Each prompt position's candidates as (token id, log probability), by id."""
    if not raw:
        return None
    return [
        None if p is None else sorted((int(k), v["logprob"]) for k, v in p.items()) for p in raw
    ]


def _logprobs(raw: Any) -> Any:
    if not raw:
        return None
    if "content" in raw:  # chat
        return [
            (p["token"], p["logprob"], [t["token"] for t in p.get("top_logprobs") or ()])
            for p in raw["content"] or ()
        ]
    return list(zip(raw.get("tokens") or (), raw.get("token_logprobs") or (), strict=False))


def _differences(a: dict[str, Any], b: dict[str, Any], where: str = "") -> list[str]:
    """Where ``a`` (vLLM) and ``b`` (kvtide) differ, logprob values within tolerance."""
    if isinstance(a, float) and isinstance(b, float):
        return [] if abs(a - b) <= LOGPROB_TOLERANCE else [f"{where}: {a} != {b}"]
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += _differences(a.get(key), b.get(key), f"{where}.{key}")
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items != {len(b)}"]
        out = []
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            out += _differences(x, y, f"{where}[{i}]")
        return out
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _same_text(tokenizer: Any, expected: Any, got: Any) -> str | None:
    """None when both prompts' token ids decode to one text (streamed turns carry no
    ids: their counts alone differ), else what differs."""
    if expected is None or got is None:
        return None
    a = tokenizer.decode(expected, skip_special_tokens=False)
    b = tokenizer.decode(got, skip_special_tokens=False)
    if a == b:
        return None
    at = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    return f"the texts differ at char {at}: {a[at : at + 40]!r} != {b[at : at + 40]!r}"


def _run(client: httpx.Client, case: Case, headers: dict[str, str]) -> list[dict[str, Any]]:
    """The case's answers, each later turn carrying the previous answer back."""
    body = {**case.body}
    answers = [_assembled(_send(client, case, body, headers))]
    for turn in case.turns[1:]:
        last = answers[-1]
        if last["status"] != 200:
            break
        choice = last["choices"][0]
        # Ids of the runner's own (see ALLOWED): both servers render these calls alike.
        calls = [
            {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(choice["tool_calls"])
        ]
        message: dict[str, Any] = {"role": "assistant", "content": choice["text"]}
        if calls:
            message["tool_calls"] = calls
        messages = [*body["messages"], message]
        messages += [
            {"role": "tool", "tool_call_id": c["id"], "content": '{"failed": true}'} for c in calls
        ]
        messages.append({"role": "user", "content": "And then?"})
        body = {**body, **turn, "messages": messages}
        if not body.get("stream"):
            body["return_token_ids"] = True  # the prompt's ids, to tell text from tokens
        answers.append(_assembled(_send(client, case, body, headers)))
    return answers


def test_kvtide_answers_the_corpus_as_vllms_own_server(kvtide_app: Any, vllm_server: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(kvtide_app.model_path)
    cases = corpus()
    model = kvtide_app.model
    failures: list[str] = []
    num_requests = 0
    continued_apart = 0
    with (
        httpx.Client(base_url=vllm_server, timeout=120) as reference,
        httpx.Client(base_url=kvtide_app.base_url, timeout=120) as kvtide,
    ):
        for case in cases:
            case = Case(
                case.name,
                case.endpoint,
                {"model": model, **case.body},
                case.turns or ({},),
                case.session,
                case.tags,
            )
            headers = {"x-session-id": f"diff-{case.name}"} if case.session else {}
            expected = _run(reference, case, {})
            got = _run(kvtide, case, headers)
            if case.session:  # its kept KV freed now, as a client that is done does
                kvtide.delete(f"/kvtide/sessions/diff-{case.name}")
            num_requests += len(expected)
            for turn, (a, b) in enumerate(zip(expected, got, strict=False)):
                if "invalid" in case.tags or a["status"] != 200:
                    # Statuses must agree; the wording may be kvtide's own (ALLOWED).
                    if a["status"] != b["status"]:
                        failures.append(
                            f"{case.name}[{turn}] status {a['status']} != {b['status']}"
                        )
                    continue
                if turn > 0 and a["usage"][0] != b["usage"][0]:
                    # Token continuity (ALLOWED): the same prompt text, other ids; the
                    # conversations part here.
                    why = _same_text(
                        tokenizer, a.get("prompt_token_ids"), b.get("prompt_token_ids")
                    )
                    if why is not None:
                        failures.append(f"{case.name}[{turn}] prompt: {why}")
                    continued_apart += 1
                    break
                a.pop("prompt_token_ids", None)
                b.pop("prompt_token_ids", None)
                for diff in _differences(a, b):
                    failures.append(f"{case.name}[{turn}]{diff}")
            else:
                if len(expected) != len(got):
                    failures.append(f"{case.name}: {len(expected)} turns != {len(got)}")
    assert num_requests >= 200
    # Most of the corpus is single turns: conversations parting by token continuity
    # must stay the exception they are.
    assert continued_apart <= 8, continued_apart
    assert not failures, f"{len(failures)} differences from vllm serve:\n" + "\n".join(
        failures[:60]
    )
