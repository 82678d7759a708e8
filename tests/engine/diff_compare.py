"""How the differential suite compares two servers' answers (``test_differential.py``):
every field both return, with each allowed difference named once, with its reason, and
counted. Tested without engines in ``tests/unit/test_diff_compare.py``."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ALLOWED", "LOGPROB_TOLERANCE", "Tally", "assembled", "masked"]

LOGPROB_TOLERANCE = 1e-3
"""fp32 on CPU: the same tokens' log probabilities from a batch of another shape (P/D
engines vs one engine) differ in the last bits; tokens must be equal."""

ALLOWED = {
    "generated ids": "id, created and system_fingerprint are made per request by each "
    "server, and so are tool-call ids (chatcmpl-tool-..., call_...)",
    "the kvtide object": "kvtide's extension: the turn's KV facts",
    "cached tokens": "usage's prompt-cache accounting (cached_tokens and created_cache_tokens; "
    "the Responses API's cached_tokens and cache_write_tokens): KV reuse differs by design "
    "(sent back from decode or the prefill's prefix cache, kvtide, which reports no cache "
    "creation: a P/D turn writes its prompt's KV on prefill and again on decode; one "
    "engine's prefix cache, vLLM)",
    "logprob within 1e-3": "fp32 numerics of different batch shapes: a log probability "
    f"within {LOGPROB_TOLERANCE} of vLLM's (the tokens themselves are equal)",
    "error object": "kvtide refuses a request with OpenAI's error object (type "
    "invalid_request_error, a string code, the parameter in OpenAI's notation) and a "
    "message of its own that names the field and the fix; vLLM with its own (type "
    "BadRequestError, the HTTP status as code): same status, the same parameter named "
    "(checked), a message on both sides",
    "token continuity": "a later turn's prompt ids, and so its answer: kvtide continues a "
    "conversation from the exact ids the decode engine produced (what its kept KV holds), "
    "vLLM tokenizes the rendered history again; where a random model's tokens are not the "
    "tokenizer's own split of their text, the ids differ while the text is equal (checked: "
    "both prompts decode to the same text), and that turn's answers may part",
    "tool calls as written": "kvtide renders a tool call it returned as the model wrote it "
    "(the tokens its kept KV holds, docs/api.md), vLLM through the chat template: the two "
    "prompts' texts differ only inside <tool_call> spans whose JSON is equal (checked), "
    "and that turn's answers may part",
}

# Keys whose values are made per request (ALLOWED["generated ids"]).
_GENERATED = frozenset(
    {"id", "created", "system_fingerprint", "created_at", "previous_response_id"}
)


# Keys of the prompt-cache accounting (ALLOWED["cached tokens"]).
_CACHE_ACCOUNTING = frozenset(
    {"cached_tokens", "created_cache_tokens", "cache_write_tokens", "cached_tokens_details"}
)


@dataclass
class Tally:
    """What a run compared: leaves equal, differences allowed by reason, failures."""

    compared: int = 0
    allowed: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    # Later turns whose prompts parted, whose answer vLLM computed again from kvtide's
    # own prompt ids (no grammar shaping it): equal token for token, or a failure.
    num_answers_by_ids: int = 0

    def allow(self, reason: str) -> None:
        assert reason in ALLOWED, reason
        self.allowed[reason] += 1

    def fail(self, where: str) -> None:
        self.failures.append(where)

    def compare(self, a: Any, b: Any, where: str = "") -> None:
        """Every leaf of ``a`` (vLLM) against ``b`` (kvtide): equal, a log probability
        within tolerance (allowed), or a failure."""
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                self.compare(a.get(key), b.get(key), f"{where}.{key}")
        elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            if len(a) != len(b):
                self.fail(f"{where}: {len(a)} items != {len(b)}")
                return
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                self.compare(x, y, f"{where}[{i}]")
        elif isinstance(a, float) and isinstance(b, float) and a != b:
            if abs(a - b) <= LOGPROB_TOLERANCE and "logprob" in where:
                self.compared += 1
                self.allow("logprob within 1e-3")
            else:
                self.fail(f"{where}: {a!r} != {b!r}")
        elif a == b:
            self.compared += 1
        else:
            self.fail(f"{where}: {a!r} != {b!r}")

    def summary(self, num_requests: int) -> str:
        lines = [
            f"differential: {num_requests} requests, {self.compared} fields compared equal, "
            f"{sum(self.allowed.values())} differences allowed, {len(self.failures)} failed"
        ]
        for reason in ALLOWED:
            lines.append(f"  allowed {self.allowed[reason]:5d}  {reason}: {ALLOWED[reason]}")
        lines.append(
            f"  parted turns answered again by vLLM from kvtide's prompt ids: "
            f"{self.num_answers_by_ids}"
        )
        return "\n".join(lines)


def masked(body: Any, tally: Tally) -> Any:
    """``body`` with the values ALLOWED to differ replaced by a marker (each counted):
    generated ids, the ``kvtide`` object, cached tokens."""
    if isinstance(body, list):
        return [masked(x, tally) for x in body]
    if not isinstance(body, dict):
        return body
    out: dict[str, Any] = {}
    for key, value in body.items():
        if key in _GENERATED and value is not None:
            tally.allow("generated ids")
            out[key] = "<generated>"
        elif key == "kvtide":
            tally.allow("the kvtide object")
        elif key in _CACHE_ACCOUNTING:
            # Left out on both sides: kvtide reports no cache creation at all.
            if value is not None:
                tally.allow("cached tokens")
        elif key in ("tool_call_id",) or (key == "id" and value is None):
            out[key] = value
        else:
            out[key] = masked(value, tally)
    return out


def _tool_call_ids(body: Any, tally: Tally) -> Any:
    """Tool calls' own ids (``call.id``) are generated: masked and counted."""
    for choice in body.get("choices") or ():
        for call in (choice.get("message") or choice.get("delta") or {}).get("tool_calls") or ():
            if call.get("id"):
                tally.allow("generated ids")
                call["id"] = "<generated>"
    return body


def assembled(answer: dict[str, Any], tally: Tally) -> dict[str, Any]:
    """An answer as compared: a full body with the allowed values masked, or a stream
    put together as a client does (each choice's text, tool calls, finish reason, log
    probabilities and token ids; the prompt's ids and the usage), its events' ids masked.
    An error: its status and its whole body."""
    answer = copy.deepcopy(answer)
    if answer["status"] != 200 or "events" not in answer:
        body = masked(_tool_call_ids(answer["body"], tally), tally)
        return {"status": answer["status"], "body": body}
    by_index: dict[int, dict[str, Any]] = {}
    usage: Any = None
    prompt_ids: Any = None
    for event in answer["events"]:
        masked(event, tally)  # every event's id and created are generated
        usage = masked(event.get("usage"), tally) or usage
        for c in event.get("choices") or ():
            got = by_index.setdefault(
                c["index"],
                {"text": "", "calls": {}, "finish_reason": None, "logprobs": [], "token_ids": []},
            )
            prompt_ids = c.get("prompt_token_ids") or prompt_ids
            delta = c.get("delta") or {}
            got["text"] += delta.get("content") or c.get("text") or ""
            for t in delta.get("tool_calls") or ():
                call = got["calls"].setdefault(t.get("index", 0), ["", ""])
                if t.get("id"):
                    tally.allow("generated ids")
                call[0] += (t.get("function") or {}).get("name") or ""
                call[1] += (t.get("function") or {}).get("arguments") or ""
            got["finish_reason"] = c.get("finish_reason") or got["finish_reason"]
            got["token_ids"] += c.get("token_ids") or ()
            logprobs = c.get("logprobs") or {}
            if "content" in logprobs:  # chat
                got["logprobs"] += logprobs["content"] or ()
            elif logprobs:  # completions: parallel lists
                got["logprobs"] += list(
                    zip(
                        logprobs.get("tokens") or (),
                        logprobs.get("token_logprobs") or (),
                        [sorted((d or {}).items()) for d in logprobs.get("top_logprobs") or ()],
                        strict=False,
                    )
                )
        prompt_ids = event.get("prompt_token_ids") or prompt_ids
    choices = [
        {
            "text": v["text"] or None,
            "tool_calls": [tuple(v["calls"][k]) for k in sorted(v["calls"])],
            "finish_reason": v["finish_reason"],
            "logprobs": v["logprobs"],
            "token_ids": v["token_ids"],
        }
        for _, v in sorted(by_index.items())
    ]
    return {"status": 200, "choices": choices, "usage": usage, "prompt_token_ids": prompt_ids}
