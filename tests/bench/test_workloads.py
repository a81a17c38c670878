"""Workload datasets: reproducible from the seed, well-formed, and unambiguous for RAG scoring.

The generators live under benchmarks/workload_generators/; the loaders in benchmarks.workloads; the one copy of
each file in benchmarks/data/, but the system prompt's, which is the kvboost package's sample (kvboost/data/).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from benchmarks import make_workloads
from benchmarks import workloads as wl
from benchmarks.workload_generators import generate as gen
from kvboost import samples

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def generated() -> dict:
    docs, items = gen.generate_rag()
    system, questions = gen.generate_system_prompt()
    return {"convs": gen.generate_conversations(), "docs": docs, "items": items, "system": system,
            "questions": questions}


def _words(text: str) -> int:
    return len(text.split())


# ------------------------------------------------------------------------------------ reproducibility

def test_shipped_files_match_generator_byte_for_byte():
    assert gen.check_workloads() == [], "run: python -m benchmarks.make_workloads"


def test_one_copy_of_the_data():
    # The system prompt is the package's sample (the demo needs it without a checkout); the rest is bench data.
    package_data = sorted(p.name for p in samples.system_prompt_file().parent.glob("*.jsonl"))
    assert package_data == [wl.SYSTEM_PROMPT_FILE]
    assert sorted(p.name for p in wl.data_dir().glob("*.jsonl")) == sorted(set(wl.ALL_FILES) - {wl.SYSTEM_PROMPT_FILE})
    assert set(gen.generate_all()) == set(wl.ALL_FILES)
    assert not (REPO / "src" / "kvboost" / "bench").exists() and not (REPO / "scripts" / "workloads").exists()


def test_generation_is_deterministic_and_seed_dependent():
    a, b = gen.generate_all(), gen.generate_all()
    assert a == b
    other = gen.generate_all(seed=gen.DEFAULT_SEED + 1)
    assert other[wl.CONVERSATIONS_FILE] != a[wl.CONVERSATIONS_FILE]
    assert other[wl.RAG_QA_FILE] != a[wl.RAG_QA_FILE]


def test_files_use_lf_and_one_json_object_per_line():
    for name in wl.ALL_FILES:
        raw = wl.shipped_path(name).read_bytes()
        assert b"\r" not in raw and raw.endswith(b"\n")
        assert all(isinstance(json.loads(line), dict) for line in raw.decode("utf-8").splitlines())


def test_import_pulls_in_no_heavy_dependencies():
    code = ("import sys, benchmarks.workloads, kvboost.cost, kvboost.samples, benchmarks.plots\n"
            "heavy = [m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "gens = [m for m in sys.modules if 'chat_domains' in m or 'policy_manual' in m or 'rag_docs' in m]\n"
            "assert not gens, gens")
    path = [str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


# ------------------------------------------------------------------------------------- conversations

def test_conversations_shape(generated):
    convs = generated["convs"]
    assert len(convs) >= 60
    assert len({c["id"] for c in convs}) == len(convs)
    for c in convs:
        assert 60 <= _words(c["system"]) <= 400, (c["id"], _words(c["system"]))
        assert 4 <= len(c["turns"]) <= 8
        assert all(isinstance(t, str) and t.strip() for t in c["turns"])
        assert len(set(c["turns"])) == len(c["turns"])
        # No template placeholder may leak into the data.
        for text in [c["system"], *c["turns"]]:
            assert not re.search(r"\{(paste:)?[a-z_]+\}", text), (c["id"], text[:80])


def test_conversations_are_varied(generated):
    convs = generated["convs"]
    domains = Counter(c["domain"] for c in convs)
    assert len(domains) >= 12 and max(domains.values()) - min(domains.values()) <= 1
    assert len({c["system"] for c in convs}) >= 0.9 * len(convs)
    assert max(_words(c["system"]) for c in convs) >= 250  # some long system prompts
    turn_words = [_words(t) for c in convs for t in c["turns"]]
    assert min(turn_words) <= 8 and max(turn_words) >= 200  # short questions to long pastes
    assert sum(w >= 80 for w in turn_words) >= 25  # multi-paragraph pastes are a real share of turns
    assert {len(c["turns"]) for c in convs} == set(range(4, 9))


# ------------------------------------------------------------------------------------------------ RAG

def test_rag_docs_shape(generated):
    docs = generated["docs"]
    assert len(docs) >= 24
    assert len({d["doc_id"] for d in docs}) == len(docs) and len({d["title"] for d in docs}) == len(docs)
    for d in docs:
        assert 150 <= _words(d["text"]) <= 380, (d["doc_id"], _words(d["text"]))


def test_rag_items_are_unambiguous(generated):
    docs = {d["doc_id"]: d for d in generated["docs"]}
    items = generated["items"]
    assert len(items) >= 60 and len({i["id"] for i in items}) == len(items)
    for it in items:
        ids = it["doc_ids"]
        assert 3 <= len(ids) <= 6 and len(set(ids)) == len(ids) and set(ids) <= set(docs)
        assert it["answer_doc_id"] in ids
        assert it["question"].endswith("?") and 0 < _words(it["answer"]) <= 5
        holders = [i for i in ids if it["answer"] in docs[i]["text"]]
        assert holders == [it["answer_doc_id"]], (it["id"], it["answer"], holders)
    # Stronger than required: answers are unique across the whole pool, so any repacking stays valid.
    for it in items:
        assert sum(it["answer"] in d["text"] for d in docs.values()) == 1


def test_rag_items_spread_over_docs_and_positions(generated):
    items = generated["items"]
    assert len({i["answer_doc_id"] for i in items}) == len(generated["docs"])
    positions = Counter(i["doc_ids"].index(i["answer_doc_id"]) for i in items)
    assert len(positions) >= 4  # the answer document is not always first or last
    assert {len(i["doc_ids"]) for i in items} == {3, 4, 5, 6}
    assert len({(i["question"], i["answer"]) for i in items}) == len(items)


# ------------------------------------------------------------------------------------- system prompt

def test_system_prompt_workload(generated):
    system, questions = generated["system"], generated["questions"]
    assert 700 <= _words(system) <= 900  # ~1000 tokens
    assert len(questions) >= 40
    assert len({q["question"] for q in questions}) == len(questions)
    for q in questions:
        assert q["type"] == "question" and q["answer"] in system


def test_support_conversations_ask_every_question_once_under_the_manual(generated):
    convs = gen.generate_support_conversations(generated["system"], generated["questions"])
    asked = [t for c in convs for t in c["turns"]]
    assert all(c["system"] == generated["system"] and 4 <= len(c["turns"]) <= 8 for c in convs)
    assert len(asked) == len(set(asked)) and len(generated["questions"]) - len(asked) < 4
    assert asked == [q["question"] for q in generated["questions"]][: len(asked)]
    assert len({c["id"] for c in convs}) == len(convs) and {c["domain"] for c in convs} == {"support"}
    assert gen.generate_support_conversations(generated["system"], generated["questions"]) == convs  # deterministic


# ------------------------------------------------------------------------------------------- loaders

def test_loaders_default_paths(generated):
    assert wl.load_conversations() == generated["convs"]
    assert wl.load_support_conversations() == gen.generate_support_conversations(generated["system"],
                                                                                 generated["questions"])
    docs, items = wl.load_rag()
    assert list(docs) == [d["doc_id"] for d in generated["docs"]] and items == generated["items"]
    assert wl.load_system_prompt() == (generated["system"], generated["questions"])


def test_loaders_accept_dir_or_file(tmp_path, generated):
    gen.write_workloads([tmp_path], seed=3)
    convs = wl.load_conversations(tmp_path)
    assert convs == wl.load_conversations(tmp_path / wl.CONVERSATIONS_FILE) != generated["convs"]
    docs, items = wl.load_rag(tmp_path / wl.RAG_QA_FILE)
    assert all(i["answer"] in docs[i["answer_doc_id"]]["text"] for i in items)
    assert wl.load_system_prompt(str(tmp_path))[0] == generated["system"]
    support = wl.load_support_conversations(tmp_path)
    assert support == wl.load_support_conversations(tmp_path / wl.SUPPORT_FILE)
    assert all(c["system"] == generated["system"] for c in support)


def test_packaged_copy_loads(generated):
    docs, items = wl.load_rag(wl.data_dir())
    assert items == generated["items"] and len(docs) == len(generated["docs"])


def test_system_prompt_loader_requires_system_record(tmp_path):
    (tmp_path / wl.SYSTEM_PROMPT_FILE).write_text('{"id": "q", "type": "question", "question": "?"}\n')
    with pytest.raises(ValueError, match="type 'system'"):
        wl.load_system_prompt(tmp_path)


def test_package_sample_is_the_system_prompt_workload(generated):
    # What the demo and the README read: the same text, the questions as plain strings.
    assert samples.load_system_prompt() == (generated["system"], [q["question"] for q in generated["questions"]])


# -------------------------------------------------------------------------------------------- script

def test_script_writes_and_checks(tmp_path, capsys):
    script = make_workloads
    assert script.main(["--check"]) == 0  # default: each file's one committed copy
    assert script.main(["--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(wl.ALL_FILES)
    assert script.main(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / wl.RAG_QA_FILE).write_text("{}\n")
    assert script.main(["--out", str(tmp_path), "--check"]) == 1
    assert "rag_qa.jsonl" in capsys.readouterr().err
