"""Sample text shipped with the package: the long support-manual system prompt and questions about it.

``kvboost demo`` and the README's quick start warm this prompt and ask its questions; it needs no checkout,
no download and no extra. The file is package data (``kvboost/data/system_prompt.jsonl``), generated, not
hand-edited: the workload generators in the repository's ``benchmarks/`` write it, and ``make workloads``
checks it byte for byte. The benchmarks read the same file.

Format, one JSON object per line: one ``{"id": "system", "type": "system", "text"}`` record, then
``{"id", "type": "question", "question", "answer"}`` records (``answer`` occurs verbatim in the prompt).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SYSTEM_PROMPT_FILE = "system_prompt.jsonl"


def system_prompt_file() -> Path:
    """Where the installed package keeps the system-prompt sample."""
    return Path(__file__).resolve().parent / "data" / SYSTEM_PROMPT_FILE


def read_system_prompt(path: str | Path) -> tuple[str, list[dict[str, Any]]]:
    """``(system prompt text, question records)`` from a file in the format above; ValueError without a
    system record."""
    with Path(path).open(encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    system = next((r["text"] for r in records if r.get("type") == "system"), None)
    if system is None:
        raise ValueError(f"{Path(path).name} has no record with type 'system'")
    return system, [r for r in records if r.get("type") == "question"]


def load_system_prompt() -> tuple[str, list[str]]:
    """``(system prompt, questions)``: a ~1,100-token customer-support manual and 40+ questions about it."""
    system, records = read_system_prompt(system_prompt_file())
    return system, [r["question"] for r in records]
