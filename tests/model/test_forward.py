"""The engine's forwards run with the attention resolve_attention picks; every choice gives HF's tokens."""
from __future__ import annotations

import pytest

from kvboost import KVBoost
from kvboost.model.attention import hf as attention_hf
from kvboost.model.forward import resolve_attention

from ..hf_reference import hf_greedy
from ..prompts import words
from ..tiny_models import make_tiny_model


@pytest.fixture
def calls(monkeypatch):
    """Counts attention calls that went through KVBoost's attention function."""
    seen = {"n": 0}
    real = attention_hf.dispatch

    def spy(*args, **kwargs):
        seen["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_hf, "dispatch", spy)
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sdpa_backend_gives_hf_tokens_in_every_path(tokenizer, calls, arch):
    model = make_tiny_model(arch, tokenizer)
    engine = KVBoost(model, tokenizer, chunk_size=16, attention_backend="sdpa")
    assert engine.attention == "sdpa"
    system = words(50, seed=3)
    engine.warm(system)
    prompts = [system + " " + words(6, seed=10 + i) for i in range(3)]
    single = [engine.generate(p, 6) for p in prompts]
    assert calls["n"] > 0
    for p, r in zip(prompts, single):
        assert r.output_token_ids == hf_greedy(model, tokenizer, engine.encode(p), 6)
    before = calls["n"]
    engine.config.shared_prefix_attention = False  # rows run their own attention (not cascade): through ours
    batched = engine.generate_batch(prompts, 6)
    assert calls["n"] > before
    assert [r.output_token_ids for r in batched] == [r.output_token_ids for r in single]


def test_auto_is_sdpa_on_cpu_and_gives_the_models_own_logits(tokenizer, calls):
    model = make_tiny_model("llama", tokenizer)
    if model.device.type != "cpu":
        pytest.skip("the CPU choice")
    engine = KVBoost(model, tokenizer, chunk_size=16)
    assert engine.attention == "sdpa" and "auto on cpu" in engine.attention_reason
    prompt = words(40, seed=1)
    engine.warm(prompt)
    result = engine.generate(prompt + " " + words(5, seed=2), 4)  # a suffix of several queries over a cache
    assert calls["n"] > 0
    assert result.output_token_ids == hf_greedy(model, tokenizer, engine.encode(prompt + " " + words(5, seed=2)), 4)


def test_auto_keeps_the_models_own_attention_where_layers_cannot_switch(tokenizer, monkeypatch):
    model = make_tiny_model("llama", tokenizer)
    monkeypatch.setattr(attention_hf, "unsupported_reason", lambda m: "its layers call attention directly")
    assert resolve_attention("auto", model) == ("model", "its layers call attention directly")


def test_bad_or_unavailable_backends_are_refused(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    with pytest.raises(ValueError, match="attention_backend"):
        KVBoost(model, tokenizer, attention_backend="flash")
    if model.device.type != "cuda":
        with pytest.raises(ValueError, match="attention_backend='triton' needs a CUDA device"):
            KVBoost(model, tokenizer, attention_backend="triton")
