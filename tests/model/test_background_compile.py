"""fast_path="auto" on a CPU (model/background_compile.py): the engine decodes eagerly, compiles its decode steps on a
twin of the model in a background thread once it has decoded a while, then runs them — with the tokens the eager path
gives, and without the compile touching what the engine's forwards read."""
from __future__ import annotations

import pytest
import torch

from kvboost import KVBoost
from kvboost.model import background_compile, fast_path
from kvboost.model.attention.static import KVBOOST_STATIC
from kvboost.model.attention.switch import attention_configs
from kvboost.model.background_compile import twin_model
from kvboost.model.runner import ModelRunner

from ..tiny_models import make_tiny_model

PROMPTS = ["Tell me a story about a fox ", "Copy this: the quick brown fox jumps over the lazy dog. " * 3, "hi"]


def _cpu_only(device: torch.device) -> None:
    if device.type != "cpu":
        pytest.skip("the background compile is the CPU fast path (CUDA runs graphs)")


def _unique_graphs() -> int:
    import torch._dynamo.utils

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture
def compiles_small_models(monkeypatch):
    """Let the tiny test models qualify, and start the compile after 4 eager decode steps."""
    import torch._dynamo

    torch._dynamo.reset()
    monkeypatch.setattr(fast_path, "MIN_LINEAR_WEIGHT_BYTES", 0)
    monkeypatch.setattr(background_compile, "START_AFTER_STEPS", 4)


def test_auto_keeps_small_models_eager_and_says_why(tokenizer, device):
    _cpu_only(device)
    engine = KVBoost(make_tiny_model("llama", tokenizer, device=device), tokenizer)
    assert engine.runner is None
    assert "would not pay back" in engine.fast_path_reason
    assert engine.cache_stats()["fast_path"]["mode"] == "off"


def test_the_twin_shares_every_weight_and_attends_statically(tokenizer, device):
    model = make_tiny_model("llama", tokenizer, device=device)
    before = [c._attn_implementation_internal for c in attention_configs(model)]
    twin = twin_model(model)
    assert twin is not model
    assert all(a is b for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    assert all(a is b for a, b in zip(model.buffers(), twin.buffers(), strict=True))
    assert {c._attn_implementation_internal for c in attention_configs(twin)} == {KVBOOST_STATIC}
    assert [c._attn_implementation_internal for c in attention_configs(model)] == before  # the model's untouched


def test_auto_decodes_eagerly_then_switches_to_the_compiled_steps_with_the_same_tokens(tokenizer, device,
                                                                                     compiles_small_models):
    _cpu_only(device)
    plain = KVBoost(make_tiny_model("llama", tokenizer, device=device), tokenizer, fast_path="off", chunk_size=16)
    auto = KVBoost(make_tiny_model("llama", tokenizer, device=device), tokenizer, chunk_size=16)
    want = [plain.generate(p, max_new_tokens=10).output_token_ids for p in PROMPTS]
    background = auto.runner.background
    assert auto.runner.mode == "compiled" and background.state == "waiting"
    assert auto.cache_stats()["fast_path"]["compiled_steps"] == []
    assert auto.generate(PROMPTS[0], max_new_tokens=3).output_token_ids == want[0][:3]
    assert background.state == "waiting" and auto.runner.stats.counts["steps"] == 0  # declined: the eager path ran
    assert auto.generate(PROMPTS[1], max_new_tokens=10).output_token_ids == want[1]  # crosses the threshold
    assert background.state in ("compiling", "ready")
    assert background.wait(timeout=600), background.error
    stats = auto.cache_stats()["fast_path"]
    assert stats["background_compile"] == "ready" and stats["compiled_steps"] == ["decode", "rows"]
    graphs = _unique_graphs()
    assert [auto.generate(p, max_new_tokens=10).output_token_ids for p in PROMPTS] == want
    assert [r.output_token_ids for r in auto.generate_batch(PROMPTS, max_new_tokens=10)] == want
    assert auto.runner.stats.counts["steps"] > 0  # the runner stepped them now
    assert _unique_graphs() == graphs  # and compiled nothing more: the twin's graphs served the engine's steps
    assert "compile_refusals" not in auto.cache_stats()["fast_path"]


def test_a_failed_background_compile_is_reported_and_decoding_stays_eager(tokenizer, device, compiles_small_models,
                                                                         monkeypatch):
    _cpu_only(device)

    def broken(self):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(ModelRunner, "compile_all", broken)
    plain = KVBoost(make_tiny_model("llama", tokenizer, device=device), tokenizer, fast_path="off")
    auto = KVBoost(make_tiny_model("llama", tokenizer, device=device), tokenizer)
    assert not auto.runner.background.wait(timeout=60)
    stats = auto.cache_stats()["fast_path"]
    assert stats["background_compile"] == "failed" and "no compiler here" in stats["decode_kernels"]
    assert auto.generate(PROMPTS[0], max_new_tokens=8).output_token_ids == \
        plain.generate(PROMPTS[0], max_new_tokens=8).output_token_ids
    assert auto.runner.stats.counts["steps"] == 0
