"""The host tier seen through the engine: reuse served from host records (or promoted back from them) gives exactly
the output of an engine that kept every chunk on the device; failed moves cost a recompute, never a request."""
from __future__ import annotations

import pytest
import torch

from kvboost import KVBoost
from kvboost.store import host as host_tier

from ..prompts import text_with_tokens, words
from ..tiny_models import make_tiny_model

CHUNK = 16
NEW = 10
PREFIX_CHUNKS = 6


@pytest.fixture
def model(tokenizer):
    return make_tiny_model("llama", tokenizer)


def chunk_bytes(model) -> int:
    """One stored 16-token chunk of the tiny fp32 model (every layer's K and V)."""
    c = model.config
    return c.num_hidden_layers * 2 * c.num_key_value_heads * CHUNK * (c.hidden_size // c.num_attention_heads) * 4


def prompt_pair(tokenizer, seed=0):
    prefix = text_with_tokens(tokenizer, PREFIX_CHUNKS * CHUNK, seed=seed)
    return prefix, prefix + " " + words(9, seed=seed + 50)


def reuse(engine, prefix, prompt):
    """Store the prefix, forget the workspace, and generate: the reuse must come from the store's tiers."""
    engine.warm(prefix)
    engine.forget_workspace()
    return engine.generate(prompt, NEW, return_logits=True)


def assert_same_output(got, want, device):
    assert got.output_token_ids == want.output_token_ids
    if device.type == "cpu":  # fp32 on a CPU: the same K/V gives bit-identical logits
        assert torch.equal(got.first_token_logits, want.first_token_logits)
    else:
        assert (got.first_token_logits - want.first_token_logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("device_chunks", [0, 2])
def test_reuse_from_the_host_tier_matches_an_engine_without_it(model, tokenizer, device, device_chunks):
    """0: every stored chunk lives on the host and is placed from there; 2: hits are promoted back to the device."""
    prefix, prompt = prompt_pair(tokenizer)
    plain = KVBoost(model, tokenizer, chunk_size=CHUNK,
                    device_kv_budget_bytes=None if device.type == "cpu" else 1 << 30)  # (CUDA: nothing moves)
    want = reuse(plain, prefix, prompt)
    assert "host" not in plain.cache_stats()["tiers"] or plain.cache_stats()["tiers"]["host"]["offloaded"] == 0
    budget = device_chunks * chunk_bytes(model)
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK, device_kv_budget_bytes=budget, memory_budget_bytes=64 << 20)
    got = reuse(engine, prefix, prompt)
    assert got.cached_tokens >= PREFIX_CHUNKS * CHUNK and got.cached_tokens == want.cached_tokens
    assert_same_output(got, want, device)
    tiers = engine.cache_stats()["tiers"]
    host, memory = tiers["host"], tiers["memory"]
    assert memory["budget_bytes"] == budget and host["budget_bytes"] == 64 << 20
    assert host["offloaded"] >= PREFIX_CHUNKS - device_chunks and host["hits"] >= PREFIX_CHUNKS - device_chunks
    assert host["failures"] == {}
    if device_chunks == 0:
        assert memory["entries"] == 0 and host["promotions"] == 0  # placed from host records
    else:
        assert host["promotions"] >= 1 and memory["entries"] == device_chunks
    assert got.output_token_ids == engine.generate(prompt, NEW, mode="baseline").output_token_ids


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_device_tier_with_a_host_tier_matches_one_without(model, tokenizer, device, bits):
    prefix, prompt = prompt_pair(tokenizer, seed=3)
    plain = KVBoost(model, tokenizer, chunk_size=CHUNK, kv_cache_bits=bits,
                    device_kv_budget_bytes=None if device.type == "cpu" else 1 << 30)
    want = reuse(plain, prefix, prompt)
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK, kv_cache_bits=bits, memory_budget_bytes=64 << 20,
                     device_kv_budget_bytes=plain.cache_stats()["tiers"]["memory"]["bytes"] // PREFIX_CHUNKS * 2)
    got = reuse(engine, prefix, prompt)
    assert got.cached_tokens == want.cached_tokens >= PREFIX_CHUNKS * CHUNK
    assert_same_output(got, want, device)  # the host kept the quantized payloads: nothing quantized twice
    host = engine.cache_stats()["tiers"]["host"]
    assert host["offloaded"] >= PREFIX_CHUNKS - 2 and host["hits"] >= PREFIX_CHUNKS - 2
    assert host["bytes"] < (host["entries"] or 1) * chunk_bytes(model) * 0.6  # payloads, not full precision


def test_failed_moves_never_fail_a_request(model, tokenizer, monkeypatch, caplog):
    def no_memory(shape, dtype, pin):
        raise host_tier.HostMoveError("alloc", "out of host memory")

    monkeypatch.setattr(host_tier, "allocate_host", no_memory)
    prefix, prompt = prompt_pair(tokenizer, seed=5)
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK, memory_budget_bytes=64 << 20,
                     device_kv_budget_bytes=2 * chunk_bytes(model))
    got = reuse(engine, prefix, prompt)
    host = engine.cache_stats()["tiers"]["host"]
    assert host["entries"] == 0 and host["failures"]["alloc"] >= PREFIX_CHUNKS - 2 and host["offloaded"] == 0
    assert got.cached_tokens < PREFIX_CHUNKS * CHUNK  # the chunks that could not move were recomputed
    assert got.output_token_ids == engine.generate(prompt, NEW, mode="baseline").output_token_ids
    assert "a move failed" in caplog.text


def test_device_budget_options(model, tokenizer, device):
    on_cpu = KVBoost(model, tokenizer, chunk_size=CHUNK, memory_budget_bytes=8 << 20,
                     device_kv_budget_bytes=1 << 20)  # no paged_kv needed any more
    tiers = on_cpu.cache_stats()["tiers"]
    assert tiers["memory"]["budget_bytes"] == 1 << 20 and tiers["host"]["budget_bytes"] == 8 << 20
    default = KVBoost(model, tokenizer, chunk_size=CHUNK, memory_budget_bytes=8 << 20).cache_stats()["tiers"]
    if device.type != "cuda":  # the device is host memory: one tier of memory_budget_bytes, as before
        assert set(default) == {"memory"} and default["memory"]["budget_bytes"] == 8 << 20
    else:  # CUDA: a share of the free device memory (kv/long_context.py), and the host tier behind it
        assert default["host"]["budget_bytes"] == 8 << 20 and default["host"]["pinned"] in (True, False)
        assert 0 < default["memory"]["budget_bytes"] < torch.cuda.get_device_properties(device).total_memory
    assert not tiers["host"]["pinned"] or device.type == "cuda"


def test_cuda_host_tier_is_page_locked_and_promotes_onto_the_gpu(model, tokenizer, device):
    if device.type != "cuda":
        pytest.skip("page-locked host records and device promotions need a CUDA device (pytest --device cuda)")
    prefix, prompt = prompt_pair(tokenizer, seed=9)
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK, memory_budget_bytes=64 << 20,
                     device_kv_budget_bytes=2 * chunk_bytes(model))
    got = reuse(engine, prefix, prompt)
    host = engine.cache_stats()["tiers"]["host"]
    assert host["pinned"] or host["unpinned_reason"], host
    assert host["promotions"] >= 1 and host["failures"] == {}
    for meta in engine.store.memory.metas():
        assert engine.store.memory.get(meta.key).keys[0].device.type == "cuda"  # promoted back onto the GPU
    assert got.output_token_ids == engine.generate(prompt, NEW, mode="baseline").output_token_ids
