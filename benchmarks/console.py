"""The console every benchmark prints to."""
from __future__ import annotations

from rich.console import Console


def bench_console() -> Console:
    """Rich console; when output goes to a file or pipe, wide enough that result tables keep every column."""
    console = Console()
    return console if console.is_terminal else Console(width=180)
