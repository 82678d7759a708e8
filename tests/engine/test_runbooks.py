"""Every command in the runbooks (docs/runbooks/*.md) works against a running kvtide.

Each ```` ```console ```` block holds commands, one per line after ``$ ``. Each runs here
with bash, as an operator would run it, against the shared app: ``$KVTIDE_URL`` is the
app, ``$KVTIDE_SESSION`` a session that ran one chat turn, ``$RAY_ADDRESS`` the Ray the
app runs in. A command must exit 0 and print something.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
RUNBOOKS = REPO / "docs" / "runbooks"
COMMAND_TIMEOUT_S = 120
_FENCE = re.compile(r"^\s*```")


def console_commands() -> list[tuple[str, str]]:
    """``(where, command)`` for each ``$ `` line of each ``console`` block, in page order;
    ``where`` is ``file:line``."""
    found = []
    for page in sorted(RUNBOOKS.glob("*.md")):
        in_block = in_console = False
        for number, line in enumerate(page.read_text().splitlines(), start=1):
            if _FENCE.match(line):
                if in_block:
                    in_block = in_console = False
                else:
                    in_block, in_console = True, line.strip() == "```console"
            elif in_console and line.startswith("$ "):
                found.append((f"{page.name}:{number}", line[2:]))
    return found


COMMANDS = console_commands()


def _chat_turn(app: Any, session_id: str) -> None:
    response = httpx.post(
        app.base_url + "/v1/chat/completions",
        json={
            "model": app.model,
            "messages": [{"role": "user", "content": "Summarise the incident log, briefly."}],
            "max_tokens": 8,
            "temperature": 0,
        },
        headers={"x-session-id": session_id},
        timeout=300,
    )
    assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def runbook_env(kvtide_app: Any) -> dict[str, str]:
    """What an operator exports before a runbook (docs/runbooks/README.md), for this app."""
    session_id = f"runbook-{uuid.uuid4().hex[:12]}"
    _chat_turn(kvtide_app, session_id)
    bin_dir = str(Path(sys.executable).parent)  # this venv's kvtide and python
    env = {
        **os.environ,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "KVTIDE_URL": kvtide_app.base_url,
        "KVTIDE_SESSION": session_id,
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
    }
    env.pop("KVTIDE_API_KEY", None)  # the test app has no API keys
    return env


def test_every_runbook_has_commands() -> None:
    pages = {where.split(":")[0] for where, _ in COMMANDS}
    expected = {p.name for p in RUNBOOKS.glob("*.md")} - {"README.md"}
    assert len(expected) == 6 and pages == expected


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_runbook_command_runs(
    kvtide_app: Any, runbook_env: dict[str, str], where: str, command: str
) -> None:
    if "$KVTIDE_SESSION" in command:
        # The session's lease is the app's short TTL: keep it alive, or start it again.
        sid = runbook_env["KVTIDE_SESSION"]
        renewed = httpx.post(f"{kvtide_app.base_url}/kvtide/sessions/{sid}/renew", timeout=30)
        if renewed.status_code == 404:
            _chat_turn(kvtide_app, sid)
    try:
        done = subprocess.run(
            ["bash", "-o", "pipefail", "-c", command],
            env=runbook_env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{where}: still running after {COMMAND_TIMEOUT_S} s: {command}")
    report = (
        f"{where}: {command}\nexit {done.returncode}\n"
        f"stdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}"
    )
    print(f"$ {command}\n{done.stdout}")  # shown with pytest -rP
    assert done.returncode == 0, report
    assert done.stdout.strip(), report
