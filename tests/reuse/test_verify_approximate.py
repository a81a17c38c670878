"""verify_approximate: approximate reuse judged by first-token agreement and KL against full prefill."""
from __future__ import annotations

from kvboost import KVBoost
from kvboost.verify import ApproximateReport, verify_correctness

from ..tiny_models import make_tiny_model


def test_full_recompute_passes_and_reports_reused_tokens(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    engine = KVBoost(model, tokenizer, chunk_size=16, recompute_strategy="cacheblend", recompute_ratio=1.0)
    report = verify_correctness(engine, max_new_tokens=6, approximate=True)
    assert isinstance(report, ApproximateReport) and report
    assert report.first_token_agreement == 1.0 and report.max_first_token_kl < 1e-6
    assert all(c.cached_tokens > 30 and c.identical for c in report.checks)
    assert "first-token agreement 100%" in report.summary()


def test_nothing_reused_is_a_failure(tokenizer):
    model = make_tiny_model("llama", tokenizer, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                 "rope_theta": 10000.0})
    engine = KVBoost(model, tokenizer, chunk_size=16)
    report = engine.verify_correctness(max_new_tokens=4, approximate=True)
    assert not report and all(c.cached_tokens == 0 for c in report.checks)
