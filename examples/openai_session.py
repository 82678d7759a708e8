"""A three-turn conversation through kvtide with the official openai client.

Start kvtide first (`kvtide up`), then: python examples/openai_session.py

Each turn sends the whole history with the same x-session-id header; kvtide pulls the
previous turn's KV back from the decode engine instead of recomputing the history, and
says so in the response's `kvtide` object and in `usage.prompt_tokens_details`.
"""

from __future__ import annotations

import os

from openai import OpenAI

BASE_URL = os.environ.get("KVTIDE_URL", "http://127.0.0.1:8000/v1")


def main() -> None:
    client = OpenAI(base_url=BASE_URL, api_key="unused")
    model = client.models.list().data[0].id
    session = {"x-session-id": "example-session-1"}
    messages = [{"role": "user", "content": "cache token engine " * 400 + "\nSummarise."}]
    for question in ["Which engine keeps the cache?", "What happens after the TTL?", None]:
        reply = client.chat.completions.create(
            model=model, messages=messages, max_tokens=24, temperature=0, extra_headers=session
        )
        usage, ext = reply.usage, (reply.model_extra or {}).get("kvtide", {})
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        print(
            f"prompt {usage.prompt_tokens:>5} tokens, {cached:>5} cached, "
            f"KV from: {ext.get('kv_source')}, TTFT {ext.get('ttft_s', 0):.3f}s"
        )
        if question is None:
            break
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": question},
        ]


if __name__ == "__main__":
    main()
