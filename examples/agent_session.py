"""An agent-style loop through kvtide's session SDK.

Start kvtide first (`kvtide up`), then:

    python examples/agent_session.py [--base-url http://127.0.0.1:8000] [--api-key KEY]

Each turn streams the model's next step, then feeds it a (fake) tool result, so the
context grows every turn the way an agent's does. Because the turns share one session,
kvtide pulls the previous turn's KV back from the decode engine instead of recomputing
the whole history: watch the "cached tok" and "KV source" columns of the table printed
at the end. The session is closed (its KV released) when the `with` block ends.
`examples/agent_tools.py` is the same loop with real tool calls and a structured answer.
"""

from __future__ import annotations

import argparse
import sys

from orchestrator.sdk import Client, KVTideAPIError, format_turns

TASK = (
    "You are a build agent. The test suite of a service fails after a dependency bump. "
    "Each turn, say which tool to run next and why, in one sentence."
)
TOOLS = ("search_logs", "read_file", "run_tests", "git_diff", "read_config", "run_linter")


def fake_tool(step: int) -> tuple[str, str]:
    """A deterministic tool result a few hundred tokens long, different every step."""
    tool = TOOLS[step % len(TOOLS)]
    lines = [
        f"[{tool}] line {i:02d}: cache token engine session decode prefill step {step}"
        for i in range(24)
    ]
    return tool, "\n".join(lines)


def run(client: Client, num_turns: int, max_tokens: int) -> None:
    with client.session(system=TASK) as session:
        print(f"session {session.id} at {client.base_url}")
        user_text = "The build is red. What do you run first?"
        for step in range(num_turns):
            print(f"\n--- turn {step + 1} ---")
            stream = session.stream(user_text, max_tokens=max_tokens, temperature=0.0)
            for delta in stream:
                print(delta, end="", flush=True)
            print()
            tool, output = fake_tool(step)
            user_text = f"Tool `{tool}` returned:\n{output}\nWhat next?"
        print()
        print(format_turns(session.turns))
        info = session.info()
        if info.record is not None:
            print(
                f"\nKV held on {info.record.engine_id}: {info.record.num_tokens} tokens "
                f"({info.record.bytes_held / 2**20:.1f} MiB); closing the session frees it."
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None, help="default: $KVTIDE_API_KEY, if set")
    parser.add_argument("--turns", type=int, default=6, help="agent steps (default 6)")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    if args.turns < 1:
        parser.error(f"--turns must be at least 1, got {args.turns}")
    try:
        with Client(args.base_url, api_key=args.api_key) as client:
            run(client, args.turns, args.max_tokens)
    except KVTideAPIError as exc:
        print(f"\nkvtide error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
