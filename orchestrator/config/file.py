"""Reading a kvtide config file: UTF-8 YAML, one value per key.

Every way a file can be unreadable becomes a ``ConfigError`` naming the file and,
where there is one, the line: bytes that are not UTF-8, YAML syntax, a key given twice
in one mapping (PyYAML would keep the last one silently: ``port: 80`` then
``port: 8080`` would serve on 8080), nesting too deep to be a config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import ConfigError

__all__ = ["read_yaml"]


def read_yaml(path: Path) -> Any:
    """The YAML document in ``path`` (an existing file), as plain Python values."""
    raw = path.read_bytes()
    name = repr(str(path))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"config file {name} is not UTF-8 text (line {line}, byte {exc.start}); save it "
            "as UTF-8"
        ) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: plain values only
    except _DuplicateKey as exc:
        raise ConfigError(
            f"config file {name}, line {exc.line}: {exc.key!r} appears twice in one mapping "
            f"(first on line {exc.first_line}); keep one",
            field=exc.key,
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {name} is not valid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"config file {name} nests too deeply to be a config") from None


class _DuplicateKey(Exception):
    def __init__(self, key: str, line: int, first_line: int) -> None:
        super().__init__(key)
        self.key, self.line, self.first_line = key, line, first_line


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # "<<: *defaults": explicit keys may override merged ones
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first_line = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the base class reports it
            if first_line is not None:
                raise _DuplicateKey(str(key), line, first_line)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)
