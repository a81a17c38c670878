"""Generate the benchmark workloads: chat conversations, RAG documents and QA items, the shared system prompt
and the support chats over it.

Everything is produced from deterministic templates and ``random.Random`` streams (no model, no network), so
``write_workloads()`` with the default seed reproduces the shipped JSONL files byte for byte. The one copy of
each file is where ``benchmarks.workloads.shipped_path`` says: ``benchmarks/data/``, and for the system prompt
the package data of ``kvboost`` (``src/kvboost/data/``, which ``kvboost demo`` reads through
``kvboost.samples``). ``python -m benchmarks.make_workloads`` drives this module.

File formats (one JSON object per line, UTF-8, ``\\n`` line endings):

* ``conversations.jsonl``: ``{"id", "domain", "system", "turns": [user messages, 4..8]}``
* ``support_conversations.jsonl``: the same fields; ``system`` is the system-prompt workload's manual and
  ``turns`` are its questions, in file order, 4..8 per chat
* ``rag_docs.jsonl``: ``{"doc_id", "title", "text"}``
* ``rag_qa.jsonl``: ``{"id", "doc_ids": [3..6 shuffled], "question", "answer", "answer_doc_id"}``;
  ``answer`` occurs verbatim in the answer document and in no other document of the pool.
* ``system_prompt.jsonl``: first line ``{"id": "system", "type": "system", "text"}``, then
  ``{"id", "type": "question", "question", "answer"}`` lines (``answer`` occurs verbatim in the prompt).
"""
from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..workloads import (
    CONVERSATIONS_FILE,
    RAG_DOCS_FILE,
    RAG_QA_FILE,
    SPEC_FILE,
    SUPPORT_FILE,
    SYSTEM_PROMPT_FILE,
    shipped_path,
)
from .chat_domains_a import DOMAINS_A, ChatDomain
from .chat_domains_b import DOMAINS_B
from .chat_pastes import PASTES
from .policy_manual import MANUAL, QUESTIONS
from .rag_docs import build_docs
from .spec_tasks import generate_spec_tasks

DEFAULT_SEED = 20240521
N_CONVERSATIONS = 64
N_RAG_ITEMS = 72
RAG_DOCS_PER_KIND = 5  # six kinds -> 30 documents

DOMAINS: tuple[ChatDomain, ...] = DOMAINS_A + DOMAINS_B

_SLOT_RE = re.compile(r"\{(\w+)\}")
_PASTE_RE = re.compile(r"\{paste:(\w+)\}")
# Short acknowledgements users prepend when continuing a thread; "" keeps many turns unprefixed.
_ACKS = ("", "", "", "", "ok, ", "thanks. ", "got it. ", "hmm, ", "great, ", "sorry, one more thing: ")
_SELF_ACKED = frozenset(("ok", "cool", "thanks", "thank", "last", "oh", "also", "great", "hmm", "sorry", "gracias",
                         "one", "look"))
_CLOSERS = ("Respond in the same language the user writes in.",
            "If the user shares personal data, do not repeat it back.",
            "Today's date is {date}.", "Ask at most one clarifying question per reply.",
            "Do not mention that you are following instructions.", "")


# ------------------------------------------------------------------------------------------ conversations

def _fill(template: str, slots: dict[str, str], rng: random.Random) -> str:
    # Slots first, pastes second: pasted code contains braces that must never be treated as slots.
    text = _SLOT_RE.sub(lambda m: slots.get(m.group(1), m.group(0)), template)
    return _PASTE_RE.sub(lambda m: PASTES[m.group(1)](rng, slots), text)


def _with_ack(text: str, rng: random.Random) -> str:
    ack = rng.choice(_ACKS)
    first = text.split(" ", 1)[0]
    # A turn that already opens with its own acknowledgement ("ok that makes sense") gets no second one.
    if not ack or first.strip(",.!:").lower() in _SELF_ACKED:
        return text
    if ack.startswith("sorry") and not text.rstrip().endswith("?"):
        return text  # "one more thing" only reads naturally before a question
    # Lower-case "Is"/"Here's" after "ok, " but leave "I", "FastAPI" or "Ayer" style words alone.
    if len(first) > 1 and first[0].isupper() and first[1:].islower() and first not in ("I'm", "I've", "I'd"):
        text = text[0].lower() + text[1:]
    return ack + text


def _system_prompt(domain: ChatDomain, slots: dict[str, str], rng: random.Random) -> str:
    persona = _fill(rng.choice(domain.personas), slots, rng)
    rules = rng.sample(domain.rules, rng.randint(2, len(domain.rules)))
    closer = rng.choice(_CLOSERS).replace("{date}", f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}")
    appendix = list(domain.appendix) if domain.appendix and rng.random() < 0.45 else []

    def render() -> str:
        parts = [persona, "Guidelines:\n" + "\n".join(f"- {r}" for r in rules)]
        parts += appendix
        if closer:
            parts.append(closer)
        return "\n\n".join(parts)

    # Keep every prompt inside the documented 60..400 word band by adding or dropping guidelines.
    spare = [r for r in domain.rules if r not in rules]
    while len(render().split()) < 60 and spare:
        rules.append(spare.pop(0))
    while len(render().split()) > 400 and len(rules) > 1:
        rules.pop()
    return render()


def _conversation(idx: int, domain: ChatDomain, rng: random.Random) -> dict[str, Any]:
    slots = {k: rng.choice(v) for k, v in domain.slots.items()}
    n_turns = rng.randint(4, 8)
    # Sample follow-ups but keep their authored order so the thread progresses naturally.
    picks = sorted(rng.sample(range(len(domain.followups)), n_turns - 1))
    turns = [_fill(rng.choice(domain.openers), slots, rng)]
    turns += [_with_ack(_fill(domain.followups[i], slots, rng), rng) for i in picks]
    return {"id": f"conv-{idx:03d}", "domain": domain.name, "system": _system_prompt(domain, slots, rng),
            "turns": turns}


def generate_conversations(seed: int = DEFAULT_SEED, n: int = N_CONVERSATIONS) -> list[dict[str, Any]]:
    """``n`` multi-turn conversations spread evenly over all personas, in shuffled order."""
    rng = random.Random(f"{seed}:conversations")
    assignment = [DOMAINS[i % len(DOMAINS)] for i in range(n)]
    rng.shuffle(assignment)
    return [_conversation(i, d, rng) for i, d in enumerate(assignment)]


# ---------------------------------------------------------------------------------------------------- RAG

def generate_rag(seed: int = DEFAULT_SEED, n_items: int = N_RAG_ITEMS,
                 docs_per_kind: int = RAG_DOCS_PER_KIND) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Return ``(docs, items)``: the document pool and multi-document QA items over it."""
    rng = random.Random(f"{seed}:rag")
    docs = build_docs(rng, docs_per_kind)
    # Belt and braces on top of _Unique: keep only answers found in exactly one document of the whole pool,
    # which guarantees uniqueness within any subset packed into an item.
    per_doc = []
    for d in docs:
        ok = [(q, a) for q, a in d.qa if sum(a in o.text for o in docs) == 1 and a in d.text]
        rng.shuffle(ok)
        per_doc.append((d, ok))
    if sum(len(ok) for _, ok in per_doc) < n_items:
        raise ValueError(f"only {sum(len(ok) for _, ok in per_doc)} unambiguous questions for {n_items} items")
    # Round-robin over documents so every document is the answer source roughly equally often.
    chosen: list[tuple[Any, str, str]] = []
    order = list(range(len(per_doc)))
    while len(chosen) < n_items:
        rng.shuffle(order)
        for j in order:
            d, ok = per_doc[j]
            if ok and len(chosen) < n_items:
                q, a = ok.pop()
                chosen.append((d, q, a))
    items = []
    for i, (target, q, a) in enumerate(chosen):
        k = rng.randint(2, 5)  # distractors -> 3..6 documents per item
        same = [d for d in docs if d.kind == target.kind and d is not target]
        other = [d for d in docs if d.kind != target.kind]
        # Same-kind distractors ("another company's founding year") make retrieval-by-position matter.
        n_same = min(rng.randint(0, k), len(same))
        picked = rng.sample(same, n_same) + rng.sample(other, k - n_same) + [target]
        rng.shuffle(picked)
        items.append({"id": f"rag-{i:03d}", "doc_ids": [d.doc_id for d in picked], "question": q, "answer": a,
                      "answer_doc_id": target.doc_id})
    doc_records = [{"doc_id": d.doc_id, "title": d.title, "text": d.text} for d in docs]
    return doc_records, items


# ---------------------------------------------------------------------------------------------- system prompt

def generate_system_prompt(seed: int = DEFAULT_SEED) -> tuple[str, list[dict[str, Any]]]:
    """Return ``(system_prompt, questions)``; question order is shuffled by the seed."""
    rng = random.Random(f"{seed}:system_prompt")
    qs = list(QUESTIONS)
    rng.shuffle(qs)
    return MANUAL, [{"id": f"sp-{i:03d}", "type": "question", "question": q, "answer": a}
                    for i, (q, a) in enumerate(qs)]


def generate_support_conversations(system: str, questions: Sequence[dict[str, Any]],
                                   seed: int = DEFAULT_SEED) -> list[dict[str, Any]]:
    """Chats with the system-prompt workload's long manual: its questions, in order, asked 4-8 per chat.

    A customer-support assistant whose manual is the system prompt (~1,000 tokens), the setting where one
    long prefix dominates every turn, as in agents with long instructions and tool descriptions.
    """
    rng = random.Random(f"{seed}:support")
    out, i = [], 0
    while len(questions) - i >= 4:
        n = min(rng.randint(4, 8), len(questions) - i)
        out.append({"id": f"support-{len(out):03d}", "domain": "support", "system": system,
                    "turns": [q["question"] for q in questions[i:i + n]]})
        i += n
    return out


# ------------------------------------------------------------------------------------------------------ I/O

def dumps_jsonl(records: Iterable[dict[str, Any]]) -> str:
    """Stable serialization: insertion-ordered keys, readable UTF-8, one record per line."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def generate_all(seed: int = DEFAULT_SEED) -> dict[str, str]:
    """Map file name -> full JSONL text for every workload file."""
    docs, items = generate_rag(seed)
    system, questions = generate_system_prompt(seed)
    conversations = generate_conversations(seed)
    return {
        CONVERSATIONS_FILE: dumps_jsonl(conversations),
        RAG_DOCS_FILE: dumps_jsonl(docs),
        RAG_QA_FILE: dumps_jsonl(items),
        SYSTEM_PROMPT_FILE: dumps_jsonl([{"id": "system", "type": "system", "text": system}, *questions]),
        SUPPORT_FILE: dumps_jsonl(generate_support_conversations(system, questions, seed)),
        SPEC_FILE: dumps_jsonl(generate_spec_tasks(docs, items, conversations)),
    }


def write_workloads(out_dirs: Sequence[str | Path] | None = None, seed: int = DEFAULT_SEED) -> list[Path]:
    """Write every workload file into each directory (default: each file's shipped copy, the one copy)."""
    written = []
    for name, text in generate_all(seed).items():
        for path in _targets(name, out_dirs):
            path.parent.mkdir(parents=True, exist_ok=True)
            # Bytes, not text mode: no platform newline translation, so files are identical everywhere.
            path.write_bytes(text.encode("utf-8"))
            written.append(path)
    return written


def check_workloads(directory: str | Path | None = None, seed: int = DEFAULT_SEED) -> list[str]:
    """Paths of files that are missing or differ from what ``seed`` generates: in ``directory``, or (None)
    the shipped copies."""
    return [str(path) for name, text in generate_all(seed).items()
            for path in _targets(name, None if directory is None else [directory])
            if not path.is_file() or path.read_bytes() != text.encode("utf-8")]


def _targets(name: str, out_dirs: Sequence[str | Path] | None) -> list[Path]:
    return [shipped_path(name)] if out_dirs is None else [Path(d) / name for d in out_dirs]
