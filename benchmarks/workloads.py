"""Benchmark workloads: load the chat, support-chat, RAG, spec and shared-system-prompt datasets.

The JSONL files live in ``benchmarks/data/``, except the system prompt, which ``kvboost demo`` needs too and
so ships inside the package (``kvboost/data/``, read through ``kvboost.samples``). They are generated, not
hand-edited: ``python -m benchmarks.make_workloads`` rebuilds them byte for byte from the generators under
``benchmarks/workload_generators/`` (which document the file formats), and ``--check`` compares.

Record shapes, one JSON object per line:

* ``conversations.jsonl`` and ``support_conversations.jsonl``: ``{"id", "domain", "system", "turns"}``
* ``rag_docs.jsonl``: ``{"doc_id", "title", "text"}``
* ``rag_qa.jsonl``: ``{"id", "doc_ids", "question", "answer", "answer_doc_id"}``
* ``system_prompt.jsonl``: one ``{"id": "system", "type": "system", "text"}`` record, then
  ``{"id", "type": "question", "question", "answer"}`` records.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvboost.samples import SYSTEM_PROMPT_FILE, read_system_prompt, system_prompt_file

CONVERSATIONS_FILE = "conversations.jsonl"
SUPPORT_FILE = "support_conversations.jsonl"
RAG_DOCS_FILE = "rag_docs.jsonl"
RAG_QA_FILE = "rag_qa.jsonl"
SPEC_FILE = "spec_tasks.jsonl"
ALL_FILES = (CONVERSATIONS_FILE, RAG_DOCS_FILE, RAG_QA_FILE, SYSTEM_PROMPT_FILE, SUPPORT_FILE, SPEC_FILE)


def data_dir() -> Path:
    """``benchmarks/data/``: the one copy of every workload but the system prompt."""
    return Path(__file__).resolve().parent / "data"


def shipped_path(filename: str) -> Path:
    """Where the committed copy of a workload file lives: the package's sample for the system prompt, else
    ``benchmarks/data/``. Every loader reads it when given no path."""
    return system_prompt_file() if filename == SYSTEM_PROMPT_FILE else data_dir() / filename


def _resolve(path: str | Path | None, filename: str) -> Path:
    if path is None:
        return shipped_path(filename)
    p = Path(path)
    return p / filename if p.is_dir() else p


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_conversations(path: str | Path | None = None) -> list[dict[str, Any]]:
    """Conversations from ``path`` (a JSONL file or a directory holding ``conversations.jsonl``)."""
    return _read_jsonl(_resolve(path, CONVERSATIONS_FILE))


def load_support_conversations(path: str | Path | None = None) -> list[dict[str, Any]]:
    """Support chats: the system-prompt workload's ~1,000-token manual as the system prompt, its questions as
    turns (4-8 per chat), the setting where one long prefix dominates every turn. ``path``: file or directory."""
    return _read_jsonl(_resolve(path, SUPPORT_FILE))


def load_rag(path: str | Path | None = None) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """``(docs by doc_id, QA items)``; ``path`` is a directory or the ``rag_qa.jsonl`` file (docs read beside it)."""
    qa_path = _resolve(path, RAG_QA_FILE)
    docs = {d["doc_id"]: d for d in _read_jsonl(qa_path.parent / RAG_DOCS_FILE)}
    return docs, _read_jsonl(qa_path)


def load_spec_tasks(path: str | Path | None = None) -> list[dict[str, Any]]:
    """`kvboost bench spec` tasks: {"id", "workload" (rag | code | extract | chat), "messages"}."""
    return _read_jsonl(_resolve(path, SPEC_FILE))


def load_system_prompt(path: str | Path | None = None) -> tuple[str, list[dict[str, Any]]]:
    """``(system prompt text, question records)`` from ``system_prompt.jsonl`` (file or directory; default: the
    package's sample, which ``kvboost.samples.load_system_prompt`` reads as plain questions)."""
    return read_system_prompt(_resolve(path, SYSTEM_PROMPT_FILE))
