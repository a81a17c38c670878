"""The server with speculative decoding: one request at a time or batched, greedy output identical, /metrics
reports drafts and acceptance; flag combinations that cannot run are refused before anything loads."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from typer.testing import CliRunner

from kvboost import KVBoost
from kvboost.server.__main__ import check_speculative_flags

from ..tiny_models import make_tiny_model
from .conftest import live_server


@pytest.mark.parametrize("max_batch_size", [1, 4], ids=["single", "batched"])
def test_speculative_server_is_identical_and_reports_acceptance(tokenizer, tiny_model_dir, max_batch_size):
    """`kvboost serve --speculative prompt_lookup`, one request at a time or batching (where rows verify their
    drafts together in ragged steps): concurrent replies equal plain generation's."""
    model = make_tiny_model("llama", tokenizer)
    plain = KVBoost(model, tokenizer, chunk_size=16)
    spec = KVBoost(model, tokenizer, chunk_size=16, speculative="prompt_lookup")
    prompts = ["river stone lantern quiet orbit " * 6, "quiet orbit " * 9, "lantern stone river " * 7]
    lengths = [40, 8, 12]  # on a batching server the longest verifies beside the others, then alone
    want = [plain.generate(p, n).output_text for p, n in zip(prompts, lengths)]
    with live_server(spec, model=str(tiny_model_dir), max_batch_size=max_batch_size) as live:
        got = live.complete_at_once(prompts, lengths)
        metrics = live.http().get("/metrics").text
    assert got == want
    drafted = [line for line in metrics.splitlines() if line.startswith("kvboost_speculative_draft_tokens_total")]
    assert drafted and float(drafted[0].split()[-1]) > 0
    assert "kvboost_speculative_acceptance_rate" in metrics
    stats = spec.cache_stats()["speculative"]
    assert stats["draft_tokens"] > 0
    batched = [line for line in metrics.splitlines() if line.startswith("kvboost_speculative_batched_proposals")]
    assert batched and float(batched[0].split()[-1]) == stats["batched_proposals"]
    if max_batch_size > 1:  # the rows verified drafts beside each other, not only once alone
        assert stats["batched_proposals"] > 0
    else:
        assert stats["batched_proposals"] == 0


def test_a_batching_server_with_a_draft_model_is_identical(tokenizer, tiny_model_dir):
    """`kvboost serve --speculative draft` batching: a draft model's rows join batches like any other row."""
    model = make_tiny_model("llama", tokenizer)
    plain = KVBoost(model, tokenizer, chunk_size=16)
    spec = KVBoost(model, tokenizer, chunk_size=16, speculative="draft",
                   draft_model=make_tiny_model("llama", tokenizer, seed=1))
    prompts = ["river stone lantern quiet orbit " * 6, "quiet orbit " * 9, "lantern stone river " * 7]
    lengths = [24, 8, 12]
    want = [plain.generate(p, n).output_text for p, n in zip(prompts, lengths)]
    with live_server(spec, model=str(tiny_model_dir), max_batch_size=4) as live:
        got = live.complete_at_once(prompts, lengths)
    assert got == want
    assert spec.cache_stats()["speculative"]["draft_tokens"] > 0


def test_flag_combinations_that_cannot_run_are_refused():
    check_speculative_flags("draft", "some/draft")  # draft-model rows join batches
    check_speculative_flags("prompt_lookup", None)  # its rows verify their drafts in the batch
    with pytest.raises(ValueError, match="--draft-model"):
        check_speculative_flags("draft", None)
    with pytest.raises(ValueError, match="only with --speculative draft"):
        check_speculative_flags(None, "some/draft")
    import typer

    from kvboost.server.__main__ import serve_command

    app = typer.Typer()
    app.command()(serve_command)
    out = CliRunner().invoke(app, ["--speculative", "ngram", "--max-batch-size", "1"])
    assert out.exit_code == 2 and "speculative" in out.output
    out = CliRunner().invoke(app, ["--speculative", "prompt_lookup", "--num-speculative-tokens", "99",
                                   "--max-batch-size", "1"])
    assert out.exit_code == 2 and "num_speculative_tokens" in out.output


def test_predicted_outputs_draft_from_the_prediction_and_change_nothing(tokenizer, tiny_model_dir):
    """OpenAI's `prediction` on a one-at-a-time server: the reply is the reply without it, streamed or not, and
    usage reports accepted / rejected prediction tokens; on a batching server it is a row like any other."""
    import httpx
    import openai

    engine = KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16)  # no speculation by default
    messages = [{"role": "user", "content": "river stone lantern quiet orbit " * 6}]
    want = engine.generate(messages=messages, max_new_tokens=24)
    with live_server(engine, model=str(tiny_model_dir), max_batch_size=1) as live:
        client = live.client()
        for prediction in (want.output_text, [{"type": "text", "text": want.output_text[:20]}, {"type": "text",
                                                                                              "text": "zebra"}]):
            r = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=24, temperature=0,
                                               prediction={"type": "content", "content": prediction})
            assert r.choices[0].message.content == want.output_text
            details = r.usage.completion_tokens_details
            assert details is not None and details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
        assert r.usage.completion_tokens_details.rejected_prediction_tokens > 0  # "zebra" was drafted and dropped
        stream = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=24,
                                                temperature=0, stream=True,
                                                prediction={"type": "content", "content": want.output_text})
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.output_text
        plain = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=24, temperature=0)
        assert plain.usage.completion_tokens_details is None  # reported only for requests with a prediction
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=4,
                                           prediction={"type": "content", "content": 5})
        assert info.value.param == "prediction"
        with httpx.Client(base_url=live.url) as http:
            r = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2,
                                                   "prediction": {"type": "content", "content": "x"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prediction"
    with live_server(engine, model=str(tiny_model_dir), max_batch_size=4) as live:
        r = live.client().chat.completions.create(model="tiny-llama", messages=messages, max_tokens=24,
                                                  temperature=0,
                                                  prediction={"type": "content", "content": want.output_text})
        assert r.choices[0].message.content == want.output_text
        assert r.usage.completion_tokens_details.accepted_prediction_tokens > 0


@pytest.mark.parametrize("max_batch_size", [1, 4])
def test_a_compiled_fast_path_server_answers_as_the_default_one(tokenizer, tiny_model_dir, device, max_batch_size):
    """kvboost serve --fast-path compiled: one request at a time, its decode steps compiled; or batching, concurrent
    requests decoded together in the compiled rows step. Replies unchanged either way."""
    if device.type != "cpu":
        pytest.skip("fast_path='compiled' is the CPU path")
    import torch._dynamo.utils

    plain = KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16)
    fast = KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16, fast_path="compiled")
    conversations = [[{"role": "user", "content": f"river stone lantern quiet orbit {i} " * (2 + i)}]
                     for i in range(3 if max_batch_size > 1 else 1)]
    want = [plain.generate(messages=m, max_new_tokens=12).output_text for m in conversations]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with live_server(fast, model=str(tiny_model_dir), max_batch_size=max_batch_size) as live, \
            ThreadPoolExecutor(len(conversations)) as pool:
        client = live.client()
        replies = list(pool.map(lambda m: client.chat.completions.create(
            model="tiny-llama", messages=m, max_tokens=12, temperature=0).choices[0].message.content, conversations))
    assert replies == want
    if max_batch_size == 1:
        assert fast.runner.stats["steps"] > 0  # the decode steps went through the compiled runner
    else:  # the batch's decode steps compiled (one graph for every row count), nothing refused
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1
        assert fast.cache_stats()["fast_path"]["compiled_steps"] == ["decode", "rows"]
        assert "compile_refusals" not in fast.cache_stats()["fast_path"]
