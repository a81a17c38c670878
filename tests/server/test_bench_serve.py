"""`kvboost bench serve` end to end on the tiny model (a short shared system prompt so it fits its context)."""
from __future__ import annotations

import json

import pytest

from kvboost.bench import serve as bench

from ..prompts import words


def test_percentile_interpolates():
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert bench.percentile([5.0], 90) == 5.0
    assert bench.percentile([10.0, 0.0], 90) == pytest.approx(9.0)


def test_bench_serve_runs_reuse_off_and_on_and_writes_json(tiny_model_dir, tmp_path, monkeypatch):
    from kvboost.bench import workloads

    system = "You are a support bot. " + words(150, seed=11)
    questions = [{"question": f"question number {i}?", "answer": ""} for i in range(8)]
    monkeypatch.setattr(workloads, "load_system_prompt", lambda path=None: (system, questions))
    out = tmp_path / "serve.json"
    bench.bench_serve_command(model=str(tiny_model_dir), clients=3, requests=2, max_tokens=3, max_batch_size=4,
                              batch_window_ms=5.0, json_path=str(out))
    report = json.loads(out.read_text())
    off, on = report["runs"]["baseline"], report["runs"]["chunk_kv_reuse"]
    assert off["requests"] == on["requests"] == 6 and off["errors"] == on["errors"] == 0
    assert off["mean_cached_tokens"] == 0 and on["mean_cached_tokens"] > 100
    assert report["requests_per_s_gain"] > 0 and report["ttft_p50_gain"] > 0
    assert set(report["targets"]) == {"requests_per_s_gain", "ttft_p50_gain"}
