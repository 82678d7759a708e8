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


def test_given_alignments_and_a_markdown_table() -> None:
    # Text that reads as numbers may be asked to stay left; the markdown separator row
    # marks the right-aligned columns, as the benchmarks' tables in the docs have them.
    text = format_table(
        ["metric", "kvtide", "ratio"],
        [["engines placed", "976", "1.00"], ["GPUs stranded", "1.4", "1.97"]],
        align=["<", ">", "<"],
        markdown=True,
    )
    assert text.splitlines() == [
        "| metric         | kvtide | ratio |",
        "|----------------|-------:|-------|",
        "| engines placed |    976 | 1.00  |",
        "| GPUs stranded  |    1.4 | 1.97  |",
    ]
