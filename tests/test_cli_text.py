"""Text the CLI fits to the terminal: help reflowed from docstrings."""
from __future__ import annotations

from kvboost.cli_help import reflowed


def test_reflowed_joins_lines_within_paragraphs_only():
    doc = """First line
        continues here.

        Second paragraph
        too."""
    assert reflowed(doc) == "First line continues here.\n\nSecond paragraph too."
