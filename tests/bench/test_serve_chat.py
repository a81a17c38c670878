"""`kvboost bench serve-chat`: a real `kvboost serve` process and the library answer the same chat, turn by turn."""
from __future__ import annotations

import math

import pytest

from benchmarks import serve_chat as bench
from benchmarks import workloads

from ..prompts import words
from ..tiny_models import make_tiny_model

pytest.importorskip("fastapi")
pytest.importorskip("openai")


def test_one_chat_through_the_server_and_the_library(tmp_path, tokenizer, monkeypatch):
    model_dir = tmp_path / "model"
    make_tiny_model("llama", tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    # The shipped manual is longer than the tiny model's context.
    system = "You are a support bot. " + words(60, seed=3)
    monkeypatch.setattr(workloads, "load_system_prompt",
                        lambda path=None: (system, [{"question": f"question {i}?"} for i in range(3)]))
    report = bench.run_serve_chat_bench(str(model_dir), turns=3, max_tokens=4, threads=1, progress=lambda m: None)
    lib, srv = report["rows"]["library"], report["rows"]["server"]
    assert [t["turn"] for t in lib] == [t["turn"] for t in srv] == [1, 2, 3]
    assert all(report["same_text"])  # greedy, same weights, same engine options: the same replies
    assert srv[2]["prompt_tokens"] > srv[1]["prompt_tokens"] > srv[0]["prompt_tokens"]  # the chat grows
    assert all(t["ttft_ms"] > 0 for t in lib + srv)
    assert math.isnan(report["server_ttft_spike"]) or report["server_ttft_spike"] >= 1.0
    bench.print_report(report)


def test_rate_of_a_chat_without_decode_is_nan():
    assert math.isnan(bench.chat_decode_rate([bench.Turn(1, 10, 5.0, 0, 0.0, "")]))
