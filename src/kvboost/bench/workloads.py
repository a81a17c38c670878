"""Benchmark workloads: load the chat, support-chat, RAG and shared-system-prompt datasets.

The JSONL files ship inside the package (``kvboost/bench/data/``), so installed benchmarks need no checkout.
They are generated, not hand-edited: ``python scripts/make_workloads.py`` rebuilds them byte for byte from the
generators under ``scripts/workloads/`` (which document the file formats), and ``--check`` compares.

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

CONVERSATIONS_FILE = "conversations.jsonl"
SUPPORT_FILE = "support_conversations.jsonl"
RAG_DOCS_FILE = "rag_docs.jsonl"
RAG_QA_FILE = "rag_qa.jsonl"
SYSTEM_PROMPT_FILE = "system_prompt.jsonl"
SPEC_FILE = "spec_tasks.jsonl"
ALL_FILES = (CONVERSATIONS_FILE, RAG_DOCS_FILE, RAG_QA_FILE, SYSTEM_PROMPT_FILE, SUPPORT_FILE, SPEC_FILE)


def package_data_dir() -> Path:
    """The workloads shipped inside the installed package: the one copy every benchmark reads by default."""
    return Path(__file__).resolve().parent / "data"


def _resolve(path: str | Path | None, filename: str) -> Path:
    if path is None:
        return package_data_dir() / filename
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
    """``(system prompt text, question records)`` from ``system_prompt.jsonl`` (file or directory)."""
    records = _read_jsonl(_resolve(path, SYSTEM_PROMPT_FILE))
    system = next((r["text"] for r in records if r.get("type") == "system"), None)
    if system is None:
        raise ValueError("system_prompt.jsonl has no record with type 'system'")
    return system, [r for r in records if r.get("type") == "question"]
