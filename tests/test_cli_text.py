"""Text the CLI fits to the terminal: one-line cuts and help reflowed from docstrings."""
from __future__ import annotations

from kvboost.cli_common import one_line
from kvboost.cli_help import reflowed


def test_one_line_collapses_whitespace_and_cuts_with_an_ellipsis():
    assert one_line("a  b\n\tc", 10) == "a b c"
    assert one_line("x" * 12, 10) == "x" * 9 + "…"
    assert len(one_line("word " * 40, 37)) == 37
    assert one_line("abc", 0) == ""


def test_reflowed_joins_lines_within_paragraphs_only():
    doc = """First line
        continues here.

        Second paragraph
        too."""
    assert reflowed(doc) == "First line continues here.\n\nSecond paragraph too."
