"""One plain-text table formatter for the CLI and the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

__all__ = ["Align", "format_table"]

Align = Literal["<", ">"]


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.3f}"
    return str(value)


def format_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    align: Sequence[Align] | None = None,
    markdown: bool = False,
) -> str:
    """Columns as wide as their widest cell. Numbers (and cells that read as numbers)
    right-aligned, text left-aligned, unless ``align`` gives each column's (``"<"`` or
    ``">"``). Plain: two spaces between columns. ``markdown``: a GitHub table, its
    separator row marking the right-aligned columns."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    aligns: Sequence[Align] = (
        align
        if align is not None
        else [
            ">"
            if rows
            and all(isinstance(row[i], (int, float)) or _looks_numeric(row[i]) for row in rows)
            else "<"
            for i in range(len(headers))
        ]
    )

    def padded(values: Sequence[str]) -> list[str]:
        return [
            v.rjust(widths[i]) if aligns[i] == ">" else v.ljust(widths[i])
            for i, v in enumerate(values)
        ]

    if markdown:
        rule = (
            "|"
            + "|".join(
                "-" * (w + 1) + (":" if a == ">" else "-")
                for w, a in zip(widths, aligns, strict=True)
            )
            + "|"
        )
        lines = ["| " + " | ".join(padded(row)) + " |" for row in [list(headers), *cells]]
        return "\n".join([lines[0], rule, *lines[1:]])
    return "\n".join("  ".join(padded(row)).rstrip() for row in [list(headers), *cells])


def _looks_numeric(value: Any) -> bool:
    text = str(value).rstrip("x%s").replace(",", "")
    try:
        float(text)
    except ValueError:
        return False
    return True
