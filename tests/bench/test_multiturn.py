"""The multi-turn replay benchmark, run end to end on a tiny model (its figures, not its timings)."""
from __future__ import annotations

import json

import pytest

from benchmarks.multiturn import run_multiturn_bench

from ..tiny_models import make_tiny_model


@pytest.mark.parametrize("workload", ["chat", "support"])
def test_replay_reuses_everything_the_previous_turn_left(tmp_path, tokenizer, workload):
    model_dir = tmp_path / "model"
    make_tiny_model("llama", tokenizer, max_position_embeddings=4096).save_pretrained(model_dir)  # support: 1.1k+
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "mt.json"
    summary = run_multiturn_bench(str(model_dir), conversations=2, turns=3, new_tokens=6, json_path=str(out),
                                  plot_path=str(tmp_path / "mt.png"), workload=workload)
    data = json.loads(out.read_text())
    assert data["workload"] == workload
    assert [s.turn for s in summary] == [1, 2, 3]
    assert data["summary"]["identical_rate"] == 1.0
    assert data["summary"]["manual_identical_rate"] == 1.0
    turn1, later = summary[0], summary[1:]
    assert turn1.reusable == 0.0  # a new conversation: the previous turn left nothing
    for s in later:
        # KVBoost reuses every token the previous turn left (its prompt and the reply) ...
        assert s.of_reusable == 1.0
        # ... which is below the whole prompt: the new user message cannot have been cached by anyone.
        assert 0.5 < s.reusable <= s.reuse < 1.0
    assert (tmp_path / "mt.png").stat().st_size > 0
