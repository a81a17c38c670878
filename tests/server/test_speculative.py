"""The server with speculative decoding: one request at a time, greedy output identical, /metrics reports drafts
and acceptance; flag combinations that cannot run are refused before anything loads."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvboost import KVBoost
from kvboost.server.__main__ import check_speculative_flags

from ..tiny_models import make_tiny_model
from .conftest import live_server


def test_speculative_server_is_identical_and_reports_acceptance(tokenizer, tiny_model_dir):
    model = make_tiny_model("llama", tokenizer)
    plain = KVBoost(model, tokenizer, chunk_size=16)
    spec = KVBoost(model, tokenizer, chunk_size=16, speculative="prompt_lookup")
    prompt = "river stone lantern quiet orbit " * 6
    want = [plain.generate(prompt, 32).output_text for _ in range(2)]
    with live_server(spec, model=str(tiny_model_dir), max_batch_size=1) as live:
        client = live.client()
        got = [client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=32, temperature=0)
               .choices[0].text for _ in range(2)]
        metrics = live.http().get("/metrics").text
    assert got == want
    drafted = [line for line in metrics.splitlines() if line.startswith("kvboost_speculative_draft_tokens_total")]
    assert drafted and float(drafted[0].split()[-1]) > 0
    assert "kvboost_speculative_acceptance_rate" in metrics
    assert spec.cache_stats()["speculative"]["draft_tokens"] > 0


def test_flag_combinations_that_cannot_run_are_refused():
    with pytest.raises(ValueError, match="max-batch-size 1"):
        check_speculative_flags("prompt_lookup", None, 16)
    with pytest.raises(ValueError, match="--draft-model"):
        check_speculative_flags("draft", None, 1)
    with pytest.raises(ValueError, match="only with --speculative draft"):
        check_speculative_flags(None, "some/draft", 1)
    check_speculative_flags("prompt_lookup", None, 1)
    import typer

    from kvboost.server.__main__ import serve_command

    app = typer.Typer()
    app.command()(serve_command)
    out = CliRunner().invoke(app, ["--speculative", "ngram", "--max-batch-size", "1"])
    assert out.exit_code == 2 and "speculative" in out.output
    out = CliRunner().invoke(app, ["--speculative", "prompt_lookup", "--num-speculative-tokens", "99",
                                   "--max-batch-size", "1"])
    assert out.exit_code == 2 and "num_speculative_tokens" in out.output
