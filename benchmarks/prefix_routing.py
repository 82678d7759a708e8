"""Prefix-aware prefill routing against Serve's load balancing, on multi-turn conversations.

    python benchmarks/prefix_routing.py [--conversations 8] [--turns 4] [--max-tokens 32]

Starts a local Ray and the kvtide app with kvtide's simulated engines (two prefill and
one decode engine on the CPU; no model weights; the prefill engines keep a prefix cache
as vLLM's does) and runs ``--conversations`` conversations of ``--turns`` turns, through
the official ``openai`` client, *without* ``x-session-id``: each turn sends the whole
history (every earlier message and answer) and a new message, so a turn can reuse KV
only from the prefill engine's prefix cache. The turns of all conversations are
interleaved (turn 1 of each, then turn 2 of each, ...), as users taking turns would.

It runs twice in one Ray: with ``routing.prefix_aware`` (the prefill request router
sends a prompt to the replica that computed its prefix) and with Serve's power-of-two
choice by load (the default). The second run's conversations are drawn with another
seed (same lengths, other words): the redeploy may keep the prefill replicas, and the
first run's prompts left in their prefix caches would count as hits. It prints for
each the prefix-cache hit rate (prompt tokens the prefill engine found cached / prompt
tokens) beside its ceiling (the share of prompt tokens that are an earlier turn's
prompt and answer; the prefill engine computed only the prompt part, in whole blocks of
128 tokens on CPU, so the hit rate stays below it), and how many later turns ran on the
replica of the conversation's first turn.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = (
    "incident service latency queue shard replica token cache prefix router node rack "
    "engine decode prefill budget lease expiry transfer block memory batch stream retry"
).split()


@dataclass(slots=True)
class Turn:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    kvtide: dict[str, Any]


def app_config(tmp: Path, *, prefix_aware: bool, port: int) -> Any:
    """Simulated engines (two prefill, one decode) on the CPU, a private Ray temp dir
    under ``tmp`` and the tiny model's tokenizer (generated under ``tmp``)."""
    from engines.tiny_model import generate_tiny_model
    from orchestrator.config import parse_config

    model = tmp / "tiny"
    if not (model / "config.json").exists():
        generate_tiny_model(model)
    return parse_config(
        {
            "backend": "simulated",
            "model": {"path": str(model), "max_model_len": 8192},
            "prefill": {"num_engines": 2, "cpu_threads_bind": None},
            "decode": {"num_engines": 1, "cpu_threads_bind": None},
            # Simulated engines in different processes cannot read each other's blocks
            # (their fabric is per process): the decode recomputes the prompt instead.
            "kv": {"kv_load_failure_policy": "recompute"},
            # Placement alone: no unnamed sessions pulling a conversation's KV back from
            # decode (simulated engines could not read it; see above).
            "routing": {"prefix_aware": prefix_aware, "reuse_without_session": False},
            "server": {"port": port, "request_timeout_s": 120},
            "ray": {"temp_dir": str(tmp / "ray"), "num_cpus": 16},
            "observability": {"metrics": False},
        }
    )


def message(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def converse(
    base_url: str,
    *,
    conversations: int,
    turns: int,
    max_tokens: int,
    num_words: int = 60,
    seed: int = 0,
) -> list[list[Turn]]:
    """Run the conversations, turns interleaved, each turn sending the whole history
    and no session header; returns each conversation's turns."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    rng = random.Random(seed)
    histories: list[list[dict[str, str]]] = [[] for _ in range(conversations)]
    out: list[list[Turn]] = [[] for _ in range(conversations)]
    for _ in range(turns):
        for i, history in enumerate(histories):
            history.append({"role": "user", "content": message(rng, num_words)})
            reply = client.chat.completions.create(
                model="kvtide-tiny",
                messages=history,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                temperature=0.0,
            )
            usage = reply.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            out[i].append(
                Turn(
                    prompt_tokens=usage.prompt_tokens,
                    completion_tokens=usage.completion_tokens,
                    cached_tokens=usage.prompt_tokens_details.cached_tokens or 0,
                    kvtide=dict((reply.model_extra or {})["kvtide"]),
                )
            )
            history.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    return out


@dataclass(frozen=True, slots=True)
class Summary:
    hit_rate: float  # cached prompt tokens / prompt tokens, all turns
    ceiling: float  # prompt tokens that are an earlier turn's prompt + answer / prompt tokens
    num_later_turns: int
    num_same_replica: int  # later turns on the replica of the conversation's first turn
    reasons: dict[str, int]


def summarize(conversations: list[list[Turn]]) -> Summary:
    prompt = cached = reusable = later = same = 0
    reasons: dict[str, int] = {}
    for turns in conversations:
        first = turns[0].kvtide.get("prefill_replica")
        for n, turn in enumerate(turns):
            prompt += turn.prompt_tokens
            cached += turn.cached_tokens
            reason = str(turn.kvtide.get("prefill_route_reason"))
            reasons[reason] = reasons.get(reason, 0) + 1
            if n:
                prev = turns[n - 1]
                reusable += min(turn.prompt_tokens, prev.prompt_tokens + prev.completion_tokens)
                later += 1
                same += turn.kvtide.get("prefill_replica") == first
    return Summary(
        hit_rate=cached / prompt if prompt else 0.0,
        ceiling=reusable / prompt if prompt else 0.0,
        num_later_turns=later,
        num_same_replica=same,
        reasons=reasons,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    from orchestrator import runtime
    from orchestrator.cluster.ports import free_port

    tmp = Path(tempfile.mkdtemp(prefix="kvt-prefix-"))
    port = free_port()
    rows: list[tuple[str, Summary]] = []
    quiet = lambda _: None  # noqa: E731
    runtime.start_ray(app_config(tmp, prefix_aware=True, port=port), say=quiet)
    try:
        runs = (("prefix-aware", True), ("pow2 (Serve default)", False))
        for seed, (name, prefix_aware) in enumerate(runs):
            config = app_config(tmp, prefix_aware=prefix_aware, port=port)
            runtime.deploy(config, say=quiet)
            turns = converse(
                f"http://{config.server.host}:{port}",
                conversations=args.conversations,
                turns=args.turns,
                max_tokens=args.max_tokens,
                seed=seed,
            )
            rows.append((name, summarize(turns)))
    finally:
        runtime.shutdown()

    print(
        f"{args.conversations} conversations x {args.turns} turns, no x-session-id, "
        "2 prefill replicas (simulated engines, 128-token KV blocks)"
    )
    from orchestrator.cli.table import format_table

    header = ["routing", "hit rate", "ceiling", "later turns on turn 1 replica", "route reasons"]
    table = [
        [
            name,
            f"{s.hit_rate:.1%}",
            f"{s.ceiling:.1%}",
            f"{s.num_same_replica}/{s.num_later_turns}",
            ", ".join(f"{k} {v}" for k, v in sorted(s.reasons.items())),
        ]
        for name, s in rows
    ]
    print(format_table(header, table, align=("<", ">", ">", ">", "<")))


if __name__ == "__main__":
    main()
