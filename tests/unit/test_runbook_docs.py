"""The runbooks (docs/runbooks/*.md) name only things the code has, and read only.

Every span and attribute name, metric, config field, stats field and recompute reason a
runbook mentions in inline code is checked against its definition, so a rename in the
code fails here instead of leaving an operator to search for a name that no longer
exists. tests/engine/test_runbooks.py runs the commands themselves.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from engines.base import EngineStats
from orchestrator.config import (
    KVConfig,
    ObservabilityConfig,
    PoolSection,
    RayConfig,
    RoutingConfig,
    ServerConfig,
)
from orchestrator.observability import tracing
from orchestrator.observability.metrics import METRICS
from policies.kv_records import KVStats, RecomputeReason

RUNBOOKS = Path(__file__).resolve().parents[2] / "docs" / "runbooks"
PAGES = sorted(p for p in RUNBOOKS.glob("*.md") if p.name != "README.md")
SECTIONS = ["## Symptoms", "## What to read", "## Commands", "## The fix"]
READ_ONLY = ("kvtide inspect ", "kvtide plan ", "curl -sf ", "python -c ")

CONFIG: dict[str, type[BaseModel]] = {
    "kv": KVConfig,
    "prefill": PoolSection,
    "decode": PoolSection,
    "decode_long": PoolSection,
    "ray": RayConfig,
    "server": ServerConfig,
    "routing": RoutingConfig,
    "observability": ObservabilityConfig,
}
# GET /kvtide/stats -> "kv": the policy's KVStats, the service's own counters, "service".
KV_STATS = set(KVStats.__dataclass_fields__) | {
    "num_sessions",
    "bytes_held",
    "num_drains",
    "num_drain_failures",
    "num_undrainable",
    "service",
    "reuse_off",
}


def _service_fields() -> set[str]:
    """The fields of the ``service`` block of ``/kvtide/stats``, as the service reports them."""
    import asyncio

    from orchestrator.kv.decider import kv_lifecycle_config
    from orchestrator.kv.service import KVService, ServiceSettings

    config = kv_lifecycle_config(
        ttl_s=480, safety_margin_s=15, recompute_threshold_tokens=64,
        kv_bytes_per_token=1, block_size_tokens=16,
    )  # fmt: skip
    service = KVService(
        config,
        prefill=None,
        settings=ServiceSettings(drain_timeout_s=1.0),
    )
    return set(asyncio.run(service.stats())["service"])


SERVICE = _service_fields()
TRACE_NAMES = {
    value
    for name, value in vars(tracing).items()
    if name.isupper() and isinstance(value, str) and value.startswith(("kvtide.", "gen_ai."))
}
METRIC_NAMES = {spec.name for spec in METRICS}

_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


def _inline_code(page: Path) -> list[str]:
    """Inline code spans outside fenced blocks."""
    text = re.sub(r"^\s*```.*?^\s*```", "", page.read_text(), flags=re.S | re.M)
    return _INLINE.findall(text)


def _console_commands(page: Path) -> list[str]:
    commands, in_block, in_console = [], False, False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            if in_block:
                in_block = in_console = False
            else:
                in_block, in_console = True, line.strip() == "```console"
        elif in_console:
            assert line.startswith("$ "), f"{page.name}: a console block holds only commands"
            commands.append(line[2:])
    return commands


def test_the_index_lists_every_runbook() -> None:
    index = (RUNBOOKS / "README.md").read_text()
    assert [p.name for p in PAGES] == [
        "engine-pending-placement.md",
        "engine-shard-lost.md",
        "idle-sessions-hold-decode-memory.md",
        "kv-transfer-failures.md",
        "later-turns-slow.md",
        "rolling-upgrade-and-head-restart.md",
    ]
    for page in PAGES:
        assert f"]({page.name})" in index


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_each_runbook_has_its_sections_in_order(page: Path) -> None:
    text = page.read_text()
    positions = [text.find("\n" + section + "\n") for section in SECTIONS]
    assert -1 not in positions and positions == sorted(positions), page.name


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_commands_only_read(page: Path) -> None:
    commands = _console_commands(page)
    assert commands, f"{page.name} has no console commands"
    for command in commands:
        assert command.startswith(READ_ONLY), command
        assert " -X " not in command and "/renew" not in command, command
        if command.startswith("curl"):
            assert '"$KVTIDE_URL/' in command, command


_TRACE = re.compile(r"(?<![\w./])((?:kvtide|gen_ai)\.[a-z_]+(?:\.[a-z_]+)*)")
_METRIC = re.compile(r"(?<!\w)(?:ray_)?(kvtide_[a-z_]+)")
_FIELD = re.compile(
    r"(?<![\w./])(kv|prefill|decode|decode_long|ray|server|routing)\.(\w+)(?:\.(\w+))?(?![\w(])"
)
_ENGINE_STAT = re.compile(r"(?<![\w.])engines\.(?:\w+|\*)\.(\w+)")


@pytest.mark.parametrize("page", [*PAGES, RUNBOOKS / "README.md"], ids=lambda p: p.name)
def test_every_name_a_runbook_uses_exists(page: Path) -> None:
    codes = _inline_code(page)
    for name in (n for code in codes for n in _TRACE.findall(code)):
        assert name in TRACE_NAMES, f"{page.name}: no span or attribute named {name}"
    for name in (n for code in codes for n in _METRIC.findall(code)):
        name = re.sub(r"_(bucket|count|sum)$", "", name)
        assert name in METRIC_NAMES, f"{page.name}: no metric named {name}"
    for section, field, sub in (f for code in codes for f in _FIELD.findall(code)):
        dotted = ".".join(filter(None, (section, field, sub)))
        if section == "kv" and field not in KVConfig.model_fields:
            # not a config field: then a GET /kvtide/stats field of "kv"
            assert field in KV_STATS, f"{page.name}: no config or stats field {dotted}"
            assert not sub or (field == "service" and sub in SERVICE), dotted
        else:
            assert field in CONFIG[section].model_fields, f"{page.name}: no config field {dotted}"
    for stat in (s for code in codes for s in _ENGINE_STAT.findall(code)):
        assert stat in EngineStats.__struct_fields__, f"{page.name}: no engine stat {stat}"


def test_the_recompute_reasons_table_covers_every_reason() -> None:
    text = (RUNBOOKS / "later-turns-slow.md").read_text()
    rows = re.findall(r"^\| `([a-z_]+)` \|", text, flags=re.M)
    assert set(rows) == {"reuse", "no_session"} | {r.value for r in RecomputeReason}
