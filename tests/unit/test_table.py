from __future__ import annotations

from orchestrator.cli.table import format_table


def test_columns_align_numbers_right_and_text_left() -> None:
    text = format_table(
        ["fault", "completed", "p99 vs none"],
        [["none", 48, "1.00x"], ["kv-service", 1200, "1.35x"]],
    )
    assert text.splitlines() == [
        "fault       completed  p99 vs none",
        "none               48        1.00x",
        "kv-service      1,200        1.35x",
    ]
