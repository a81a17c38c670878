"""`kvboost bench cluster`'s replay (benchmarks/cluster.py) against one live server on the tiny model: every turn is
recorded with its prompt and cached tokens, later turns reuse the earlier ones, and the summary's arithmetic. The
three Ray configurations themselves run only as the benchmark (minutes on the embedded model)."""
from __future__ import annotations

import pytest

from benchmarks.cluster import ConfigResult, Turn, interleave, rag_requests, replay
from kvboost import KVBoost

from ..tiny_models import make_tiny_model

pytest.importorskip("fastapi")


def test_replay_records_every_turn_and_later_turns_reuse_earlier_ones(tokenizer):
    from kvboost.server import BackgroundServer, ServerSettings, create_app

    engine = KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16)
    chats = [{"system": f"You are assistant {i}. " + "Answer briefly and kindly. " * 8,
              "turns": ["Hello there.", "Tell me more.", "Unused third turn."]} for i in range(3)]
    chats.append({"system": "A shared document. " * 20, "turns": ["A question on it?"], "kind": "rag"})
    with BackgroundServer(create_app(engine, ServerSettings(served_model_name="kvboost"))) as srv:
        turns = replay(srv.base_url, chats, turns=2, clients=2, max_tokens=4)
    assert sorted((t.conversation, t.turn) for t in turns) == [(c, t) for c in range(3) for t in range(2)] + [(3, 0)]
    assert [t.kind for t in turns if t.conversation == 3] == ["rag"]
    for t in turns:
        assert 0 <= t.cached_tokens <= t.prompt_tokens and t.ttft_ms > 0
    later = [t for t in turns if t.turn == 1]
    assert all(t.cached_tokens >= 32 for t in later)  # the system prompt and the first turn, whole chunks


def test_summary_arithmetic():
    result = ConfigResult("kvboost", 2, [Turn(0, 0, 100, 0, 50.0, "a"), Turn(0, 1, 200, 150, 10.0, "a"),
                                         Turn(1, 0, 100, 50, 30.0, "b", "rag")], seconds=2.0)
    s = result.summary()
    assert s["cached_share"] == 200 / 400 and s["ttft_p50_ms"] == 30.0 and s["ttft_p50_later_turns_ms"] == 10.0
    assert s["cached_share_chat"] == 150 / 300 and s["cached_share_rag"] == 0.5 and s["ttft_p99_ms"] == 50.0
    assert s["requests_per_replica"] == [2, 1] and s["requests_per_s"] == 1.5


def test_rag_requests_share_documents_and_are_spread_over_the_replay():
    rag = rag_requests(32)
    assert len(rag) == 32 and all(r["kind"] == "rag" and len(r["turns"]) == 1 for r in rag)
    systems = [r["system"] for r in rag]
    assert len(set(systems)) <= 16  # every document is asked about at least twice
    first_repeat = next(i for i, s in enumerate(systems) if s in systems[:i])
    assert first_repeat == len(set(systems))  # each document's second question only after every first one
    mixed = interleave([{"turns": ["c"]}] * 3, rag[:2])
    assert [m.get("kind", "chat") for m in mixed] == ["chat", "rag", "chat", "rag", "chat"]
