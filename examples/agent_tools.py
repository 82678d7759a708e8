"""A tool-calling agent through kvtide's session SDK.

Start kvtide with tool calling on (a `tool_call_parser` and `enable_auto_tool_choice`,
see docs/api.md), then:

    python examples/agent_tools.py [--base-url http://127.0.0.1:8000] [--api-key KEY]

The model gets two tools over a small, made-up repository. Whenever its reply calls
tools the example runs them and answers every call in the same session; the SDK sends
the reply's `tool_calls` back exactly as the server returned them, followed by one
`tool` message per call, as the OpenAI protocol requires. Because all turns share one
session, kvtide sends the previous turn's KV back instead of recomputing the growing
history (the "KV source" column). The last turn asks for a verdict in a JSON schema
made from a pydantic model and prints it parsed.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import pydantic

from orchestrator.sdk import Client, KVTideSDKError, ToolCall, format_turns

TASK = (
    "You are a build agent. The test suite of a service fails after a dependency bump. "
    "Use the tools to find out why; answer in two sentences once you know."
)
FILES = {
    "requirements.txt": "httpx==0.28.0\npydantic==2.9.0\nuvicorn==0.30.0\n",
    "logs/test.log": (
        "FAILED tests/test_client.py::test_timeout - TypeError: Client.__init__() got an "
        "unexpected keyword argument 'proxies'\n1 failed, 212 passed in 14.2s\n"
    ),
    "src/client.py": "import httpx\n\nclient = httpx.Client(proxies=PROXIES, timeout=5)\n",
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "list_files",
            "description": "List the files of the repository.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read one file of the repository.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
]


class Verdict(pydantic.BaseModel):
    """The structured answer of the last turn."""

    culprit_package: str
    failing_file: str
    fix: str


def call_tool(call: ToolCall) -> str:
    """Run one tool call; a mistake of the model's is answered as text, not raised."""
    try:
        args = call.args() or {}
    except KVTideSDKError as exc:
        return f"error: {exc}"
    if call.name == "list_files":
        return json.dumps(sorted(FILES))
    if call.name == "read_file":
        path = str(args.get("path", ""))
        return FILES.get(path, f"error: no file {path!r}; call list_files")
    return f"error: no tool named {call.name!r}"


def run(client: Client, max_steps: int = 6, max_tokens: int = 256) -> Verdict | None:
    sampling: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0}
    with client.session(system=TASK) as session:
        print(f"session {session.id} at {client.base_url}")
        result = session.send("The build is red. Why?", tools=TOOLS, **sampling)
        for _ in range(max_steps):
            if not result.tool_calls:
                break
            for call in result.tool_calls:
                output = call_tool(call)
                print(f"  {call.name}({call.arguments}) -> {len(output)} characters")
                session.add_tool_result(call.id, output)
            result = session.send(tools=TOOLS, **sampling)
        for call in result.tool_calls:  # out of steps: every call still needs an answer
            session.add_tool_result(call.id, "not run: the step limit was reached")
        print(f"\n{result.text}\n")
        verdict = session.send("Give your verdict.", response_format=Verdict, **sampling)
        print(verdict.parsed)
        print()
        print(format_turns(session.turns))
        parsed: Verdict | None = verdict.parsed
        return parsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None, help="default: $KVTIDE_API_KEY, if set")
    parser.add_argument("--max-steps", type=int, default=6, help="tool rounds (default 6)")
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    try:
        with Client(args.base_url, api_key=args.api_key) as client:
            run(client, args.max_steps, args.max_tokens)
    except KVTideSDKError as exc:
        print(f"\nkvtide error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
