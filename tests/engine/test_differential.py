"""kvtide against vLLM's own OpenAI server, request by request: the same corpus
(``corpus.py``: chat and completions, tools with tool_choice required/named/none/auto,
json_object and json_schema, logprobs, ``n``, stop strings, seeds, penalties, logit
bias, streamed and not, multi-turn conversations with tool results, sessions on and
off, invalid requests) sent to ``vllm serve`` on the same tiny model (one engine, fp32,
greedy or seeded) and to kvtide (P/D, sessions, KV sent back), compared field by field.

Every field both servers return is compared; every difference fails the suite unless it is
one of ``diff_compare.ALLOWED``, each with its reason, counted; the counts are printed.
Later turns of a conversation send both servers the same history (kvtide's answers, its
tool calls under the ids kvtide returned, as an agent sends them back), so every turn is
compared, and ``/v1/responses`` chains run against vLLM's own Responses API.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from corpus import Case, corpus
from diff_compare import Tally, assembled

from benchmarks.common import vllm_server as serve_vllm

pytestmark = pytest.mark.engine


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
        env={"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0", "VLLM_ENABLE_RESPONSES_API_STORE": "1"},
        log_path=short_tmp / "vllm-serve.log",
    ) as base:
        yield base


ENDPOINTS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
# Bounds that a broken turn path reaches. Token continuity parts a quarter of the later
# turns at most (3 of 17 seen). A tool call kvtide rendered as the model wrote it parts
# the turns after it: in the corpus's conversations the two after the named call (its
# arguments written alone, not in the template's <tool_call> span), 8 in all.
MAX_CONTINUITY_SHARE = 0.25
MAX_AS_WRITTEN = 8
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def _send(client: httpx.Client, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
    if not body.get("stream"):
        r = client.post(path, json=body, headers=headers)
        return {"status": r.status_code, "body": r.json()}
    with client.stream("POST", path, json=body, headers=headers) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "body": r.json()}
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return {"status": 200, "events": events}


_SEGMENT = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>|$)", re.S)


def _calls_of(content: str) -> list[Any] | None:
    """The arguments of the tool calls an assistant turn's text holds, as JSON: the chat
    template's ``<tool_call>`` spans, or the model's own writing under a tool choice's
    grammar (a named tool: its arguments object; required: a list of calls)."""
    try:
        spans = _TOOL_CALL.findall(content)
        if spans:
            return [json.loads(span)["arguments"] for span in spans]
        written = json.loads(content)
    except (ValueError, KeyError, TypeError):
        return None
    if isinstance(written, list):
        return [c.get("parameters", c.get("arguments")) for c in written if isinstance(c, dict)]
    return [written]


def _same_but_calls(a: str, b: str) -> bool:
    """Whether two rendered prompts are the same conversation, turn by turn, where the
    assistant turns that differ hold the same tool calls (ALLOWED["tool calls as
    written"])."""
    turns_a, turns_b = _SEGMENT.findall(a), _SEGMENT.findall(b)
    if len(turns_a) != len(turns_b):
        return False
    for (role_a, text_a), (role_b, text_b) in zip(turns_a, turns_b, strict=True):
        if role_a != role_b or (text_a != text_b and role_a != "assistant"):
            return False
        if text_a != text_b and (
            _calls_of(text_a) is None or _calls_of(text_a) != _calls_of(text_b)
        ):
            return False
    return True


def _prompts_part(tokenizer: Any, expected: Any, got: Any) -> tuple[str | None, str | None]:
    """Why two turns' prompt ids differ, as an ALLOWED reason, or what differs."""
    if expected is None or got is None:
        missing = f"vLLM {expected is not None}, kvtide {got is not None}"
        return None, f"a prompt's ids are missing: {missing}"
    a = tokenizer.decode(expected, skip_special_tokens=False)
    b = tokenizer.decode(got, skip_special_tokens=False)
    if a == b:
        return "token continuity", None
    if _same_but_calls(a, b):
        return "tool calls as written", None
    at = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    return None, f"the texts differ at char {at}: {a[at : at + 60]!r} != {b[at : at + 60]!r}"


def _shaped(body: dict[str, Any]) -> bool:
    """Whether a grammar shapes the answer (a tool choice that forces a call, a response
    format): a completion of the same ids without it is no reference."""
    choice = body.get("tool_choice")
    return bool(body.get("response_format")) or (
        choice not in (None, "none", "auto") and bool(body.get("tools"))
    )


def _answer_of_ids(
    tally: Tally, reference: httpx.Client, where: str, body: dict[str, Any], b: dict[str, Any]
) -> None:
    """A later turn whose prompt parted from vLLM's: vLLM completes kvtide's own prompt
    ids (as a completion of those ids) and must give kvtide's answer tokens, where no
    grammar shapes the answer."""
    if _shaped(body) or body.get("temperature", 1.0) != 0:
        return
    got = (b["choices"] if "choices" in b else b["body"]["choices"])[0].get("token_ids")
    ids = _prompt_ids(b)
    r = reference.post(
        "/v1/completions",
        json={
            "model": body["model"],
            "prompt": ids,
            "max_tokens": body["max_tokens"],
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    tally.num_answers_by_ids += 1
    tally.compare(r.json()["choices"][0]["token_ids"], got, f"{where} answer to kvtide's ids")


def _next_body(
    body: dict[str, Any], turn: dict[str, Any], answer: dict[str, Any]
) -> dict[str, Any]:
    """The next turn's request: the history with kvtide's answer, its tool calls under the
    ids kvtide returned (as an agent sends them back), their results and a question."""
    message = dict(answer["body"]["choices"][0]["message"])
    message = {k: v for k, v in message.items() if k in ("role", "content", "tool_calls") and v}
    message.setdefault("content", None)
    calls = message.get("tool_calls") or []
    messages = [*body["messages"], message]
    messages += [
        {"role": "tool", "tool_call_id": c["id"], "content": '{"failed": true}'} for c in calls
    ]
    messages.append({"role": "user", "content": "And then?"})
    return {**body, **turn, "messages": messages}


def _compare_turn(
    tally: Tally, tokenizer: Any, where: str, a: dict[str, Any], b: dict[str, Any], later: bool
) -> bool:
    """One turn's answers; False when its prompts parted (an allowed reason, counted)."""
    if later and a["status"] == b["status"] == 200:
        ids_a, ids_b = _prompt_ids(a), _prompt_ids(b)
        if ids_a != ids_b:
            reason, failure = _prompts_part(tokenizer, ids_a, ids_b)
            if failure is not None:
                tally.fail(f"{where} prompt: {failure}")
            else:
                tally.allow(str(reason))
            return False
    tally.compare(a, b, where)
    return True


def _prompt_ids(answer: dict[str, Any]) -> Any:
    if "prompt_token_ids" in answer:
        return answer["prompt_token_ids"]
    return (answer.get("body") or {}).get("prompt_token_ids")


def _run_case(
    tally: Tally,
    tokenizer: Any,
    reference: httpx.Client,
    kvtide: httpx.Client,
    case: Case,
    model: str,
) -> tuple[int, int, int]:
    """A case's turns on both servers: (requests, later turns, later turns parted)."""
    headers = {"x-session-id": f"diff-{case.name}"} if case.session else {}
    body = {"model": model, "return_token_ids": True, **case.body}
    path = ENDPOINTS[case.endpoint]
    num_requests = later = parted = 0
    last: dict[str, Any] = {}
    for turn_index, turn in enumerate(case.turns or ({},)):
        if turn_index:
            body = _next_body(body, turn, last)
            later += 1
        vllm_raw = _send(reference, path, body, {})
        kvtide_raw = _send(kvtide, path, body, headers)
        num_requests += 1
        a, b = assembled(vllm_raw, tally), assembled(kvtide_raw, tally)
        where = f"{case.name}[{turn_index}]"
        if a["status"] != 200 or b["status"] != 200:
            _compare_error(tally, where, a, b)
            break
        if not _compare_turn(tally, tokenizer, where, a, b, later=turn_index > 0):
            parted += 1
            _answer_of_ids(tally, reference, where, body, b)
        # The next turn carries kvtide's answer back, as a client of kvtide does.
        last = _streamed_message(kvtide_raw["events"]) if "events" in kvtide_raw else kvtide_raw
    if case.session:  # its kept KV freed now, as a client that is done does
        kvtide.delete(f"/kvtide/sessions/diff-{case.name}")
    return num_requests, later, parted


def _compare_error(tally: Tally, where: str, a: dict[str, Any], b: dict[str, Any]) -> None:
    """An error answer: the same status, and the same parameter named; kvtide's error
    object is OpenAI's, with a message of its own (ALLOWED, counted)."""
    if a["status"] != b["status"]:
        tally.fail(f"{where} status {a['status']} != {b['status']}: {b['body']}")
        return
    if a["status"] == 200:
        tally.compare(a, b, where)
        return
    ea, eb = (a["body"].get("error") or a["body"]), (b["body"].get("error") or b["body"])
    tally.compare(a["status"], b["status"], f"{where}.status")
    if not (ea.get("message") and eb.get("message")):
        tally.fail(f"{where}: an error without a message: {ea} / {eb}")
    if ea.get("param") is not None and _param(ea["param"]) != _param(eb.get("param")):
        tally.fail(f"{where}: vLLM names {ea['param']!r}, kvtide {eb.get('param')!r}")
    tally.allow("error object")


def _param(name: Any) -> str:
    """A parameter's path in one notation: ``body.tools.0.function`` (pydantic's, as
    vLLM gives it) and ``tools[0].function`` (OpenAI's) alike."""
    text = re.sub(r"\[(\d+)\]", r".\1", str(name))
    return text.removeprefix("body.")


def _streamed_message(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed chat answer as the body a client sends back: its text and its tool
    calls under the ids kvtide streamed."""
    text, calls = "", {}
    for event in events:
        for c in event.get("choices") or ():
            delta = c.get("delta") or {}
            text += delta.get("content") or ""
            for t in delta.get("tool_calls") or ():
                call = calls.setdefault(
                    t.get("index", 0), {"id": None, "name": "", "arguments": ""}
                )
                call["id"] = t.get("id") or call["id"]
                call["name"] += (t.get("function") or {}).get("name") or ""
                call["arguments"] += (t.get("function") or {}).get("arguments") or ""
    tool_calls = [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["name"], "arguments": c["arguments"]},
        }
        for _, c in sorted(calls.items())
    ]
    message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
    return {"body": {"choices": [{"message": message}]}}


RESPONSES_CHAINS = (
    # One-token answers: a token's text tokenizes back to that token, so both servers'
    # chains hold the same history (vLLM's renders the stored answers again, kvtide's
    # continues from their ids) and every turn is compared whole. Longer answers part
    # by token continuity, which the Responses API, returning no ids, cannot show.
    (" ".join(f"w{i % 89}" for i in range(500)) + "\nSummarise.", ("Which engine?", "Why?"), 1),
    ("The rack's cache failed at 03:12. What now?", ("And then?", "Go on.", "Why?"), 1),
)


def _responses_chain(
    tally: Tally, reference: httpx.Client, kvtide: httpx.Client, model: str, k: int
) -> tuple[int, int, int]:
    """A ``previous_response_id`` chain on both servers (vLLM's own Responses API and its
    store; kvtide's session): every field of every turn, until the chains' prompts part
    by token continuity (the Responses API returns no ids: allowed only where the input
    counts differ by no more than the answers so far could re-tokenize to, twice their
    tokens; a lost history differs by hundreds). (requests, later turns, parted)"""
    first, later, max_tokens = RESPONSES_CHAINS[k]
    previous: dict[str, str] = {}
    answered = 0
    for turn, text in enumerate((first, *later)):
        body = {"model": model, "input": text, "max_output_tokens": max_tokens, "temperature": 0}
        answers = []
        for name, client in (("vllm", reference), ("kvtide", kvtide)):
            extra = {"previous_response_id": previous[name]} if name in previous else {}
            answer = _send(client, "/v1/responses", {**body, **extra}, {})
            if answer["status"] == 200:
                previous[name] = answer["body"]["id"]
            answers.append(assembled(answer, tally))
        a, b = answers
        where = f"responses-{k}[{turn}]"
        if a["status"] == b["status"] == 200:
            apart = a["body"]["usage"]["input_tokens"] - b["body"]["usage"]["input_tokens"]
            if turn and apart:
                if abs(apart) > 2 * answered:
                    tally.fail(f"{where}: input tokens {apart:+d} apart after {answered}")
                else:
                    tally.allow("token continuity")
                _close_chain(kvtide, previous)
                return turn + 1, turn, 1
            answered += b["body"]["usage"]["output_tokens"]
        tally.compare(a, b, where)
        if a["status"] != 200:
            break
    _close_chain(kvtide, previous)
    return 1 + len(later), len(later), 0


def _close_chain(kvtide: httpx.Client, previous: dict[str, str]) -> None:
    """kvtide's chain freed, as a client that is done does (its last response deleted
    closes its session): the tests after this one share the decode's idle budget."""
    if "kvtide" in previous:
        assert kvtide.delete(f"/v1/responses/{previous['kvtide']}").status_code == 200


def test_kvtide_answers_the_corpus_as_vllms_own_server(
    kvtide_app: Any, vllm_server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(kvtide_app.model_path)
    tally = Tally()
    num_requests = num_later = num_parted = 0
    with (
        httpx.Client(base_url=vllm_server, timeout=120) as reference,
        httpx.Client(base_url=kvtide_app.base_url, timeout=120) as kvtide,
    ):
        for case in corpus():
            n, later, parted = _run_case(
                tally, tokenizer, reference, kvtide, case, kvtide_app.model
            )
            num_requests += n
            num_later += later
            num_parted += parted
        for k in range(len(RESPONSES_CHAINS)):
            n, later, parted = _responses_chain(tally, reference, kvtide, kvtide_app.model, k)
            num_requests += n
            num_later += later
            num_parted += parted
    with capsys.disabled():
        print("\n" + tally.summary(num_requests))
        print(f"  later turns {num_later}, of which {num_parted} parted from vLLM's prompt")
        for failure in tally.failures:
            print("  FAILED", failure[:400])
    assert not tally.failures, f"{len(tally.failures)} differences from vllm serve:\n" + "\n".join(
        tally.failures[:80]
    )
    assert num_requests >= 200 and num_later >= 16
    assert tally.compared > 10 * num_requests
    assert tally.allowed["token continuity"] <= MAX_CONTINUITY_SHARE * num_later, num_later
    assert tally.allowed["tool calls as written"] <= MAX_AS_WRITTEN
