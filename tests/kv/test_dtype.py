"""kv/dtype.py: K/V kept narrower than the model computes in (kv_dtype). "auto" narrows INT4 weights on a CPU with
bfloat16 instructions only; a narrow cache holds half the bytes in the workspace and every tier, every path writes and
reads it (eager, static steps, batches, disk), and reuse over it stays exact against the engine's own baseline."""
from __future__ import annotations

import pytest
import torch

from kvboost import KVBoost
from kvboost.kv import dtype as kv_dtype_module
from kvboost.kv.dtype import resolve_kv_dtype

from ..prompts import text_with_tokens, words
from ..tiny_models import make_tiny_model

CPU = torch.device("cpu")
CHUNK = 16


def test_auto_narrows_only_int4_weights_on_a_cpu_with_bfloat16(monkeypatch):
    monkeypatch.setattr(kv_dtype_module, "native_bf16_cpu", lambda: True)
    dtype, why = resolve_kv_dtype("auto", torch.float32, CPU, "sdpa", "int4")
    assert dtype == torch.bfloat16 and "int4" in why
    assert resolve_kv_dtype("auto", torch.float32, CPU, "sdpa", None)[0] == torch.float32  # float weights: exact
    assert resolve_kv_dtype("auto", torch.float32, CPU, "model", "int4")[0] == torch.float32
    assert resolve_kv_dtype("auto", torch.float32, torch.device("cuda"), "triton", "int4")[0] == torch.float32
    assert resolve_kv_dtype("auto", torch.bfloat16, CPU, "sdpa", "int4")[0] == torch.bfloat16
    monkeypatch.setattr(kv_dtype_module, "native_bf16_cpu", lambda: False)
    dtype, why = resolve_kv_dtype("auto", torch.float32, CPU, "sdpa", "int4")
    assert dtype == torch.float32 and "no bfloat16 instructions" in why
    assert resolve_kv_dtype("float16", torch.float32, CPU, "sdpa", None)[0] == torch.float16
    assert resolve_kv_dtype("model", torch.bfloat16, CPU, "sdpa", "int4")[0] == torch.bfloat16


def test_a_narrow_cache_needs_kvboosts_attention(tokenizer, device):
    model = make_tiny_model("llama", tokenizer, device=device)
    with pytest.raises(ValueError, match="kv_dtype='bfloat16' needs KVBoost's attention"):
        KVBoost(model, tokenizer, kv_dtype="bfloat16", attention_backend="model")
    KVBoost(model, tokenizer, kv_dtype="float32", attention_backend="model")  # the model's own dtype: fine


@pytest.fixture(params=["llama", "gemma3"])  # GQA; gemma3 adds sliding layers and query/key norms
def narrow(request, tokenizer, device):
    """(fp32-K/V engine, bf16-K/V engine) over one tiny float32 model."""
    model = make_tiny_model(request.param, tokenizer, device=device)
    return (KVBoost(model, tokenizer, chunk_size=CHUNK, fast_path="off"),
            KVBoost(model, tokenizer, chunk_size=CHUNK, fast_path="off", kv_dtype="bfloat16"))


def test_the_workspace_and_stored_chunks_hold_half_the_bytes(narrow, tokenizer):
    wide, half = narrow
    assert half.kv_dtype == torch.bfloat16 and wide.kv_dtype == torch.float32
    assert half.cache_stats()["plan"]["kv_dtype"].startswith("kv_dtype='bfloat16'")
    prompt = text_with_tokens(tokenizer, 6 * CHUNK, seed=1)
    for engine in narrow:
        engine.warm(prompt)
    assert all(b.dtype == torch.bfloat16 for b in half.kv_workspace.buffers(0))
    stored = [e.cache_stats()["tiers"]["memory"]["bytes"] for e in narrow]
    assert stored[1] * 2 == stored[0] > 0
    assert half.kv_workspace.nbytes * 2 == wide.kv_workspace.nbytes


def test_narrow_kv_stays_close_to_float_kv(narrow, tokenizer):
    prompt = text_with_tokens(tokenizer, 5 * CHUNK, seed=2)
    a, b = (e.generate(prompt, 1, return_logits=True).first_token_logits for e in narrow)
    assert not torch.equal(a, b)  # the K/V really were rounded
    assert (a - b).abs().max() <= 0.02 * a.abs().max()


def test_reuse_over_a_narrow_cache_is_exact(narrow, tokenizer):
    _, half = narrow
    assert half.verify_correctness(max_new_tokens=8).all_identical
    prefix = text_with_tokens(tokenizer, 6 * CHUNK, seed=3)
    prompt = prefix + " " + words(9, seed=4)
    half.warm(prefix)
    half.forget_workspace()
    reused = half.generate(prompt, 8)
    assert reused.cached_tokens >= 6 * CHUNK
    assert reused.output_token_ids == half.generate(prompt, 8, mode="baseline").output_token_ids


def test_batches_and_static_steps_over_a_narrow_cache_give_the_eager_tokens(tokenizer, device):
    model = make_tiny_model("llama", tokenizer, device=device)
    eager = KVBoost(model, tokenizer, chunk_size=CHUNK, fast_path="off", kv_dtype="bfloat16")
    prompts = [text_with_tokens(tokenizer, 3 * CHUNK + 5 * i, seed=10 + i) for i in range(3)]
    want = [eager.generate(p, 10).output_token_ids for p in prompts]
    static = "compiled" if device.type == "cpu" else "graphs"
    stepped = KVBoost(model, tokenizer, chunk_size=CHUNK, fast_path=static, kv_dtype="bfloat16")
    assert stepped.runner.mode == static
    for engine in (eager, stepped):
        assert [r.output_token_ids for r in engine.generate_batch(prompts, 10)] == want
        assert [engine.generate(p, 10).output_token_ids for p in prompts] == want
    assert stepped.cache_stats()["fast_path"]["steps"] > 0


def test_a_narrow_disk_tier_reloads_exactly(tokenizer, tmp_path):
    model = make_tiny_model("llama", tokenizer)
    prefix = text_with_tokens(tokenizer, 6 * CHUNK, seed=5)
    prompt = prefix + " " + words(7, seed=6)
    for bits in (16, 8):
        options = dict(chunk_size=CHUNK, kv_dtype="bfloat16", kv_cache_bits=bits,
                       disk_cache_dir=str(tmp_path / str(bits)))
        writer = KVBoost(model, tokenizer, **options)
        writer.warm(prefix)
        writer.close()
        reader = KVBoost(model, tokenizer, **options)
        result = reader.generate(prompt, 8)
        assert result.cached_tokens >= 6 * CHUNK and reader.cache_stats()["tiers"]["disk"]["hits"] >= 6
        if bits == 16:  # quantized records are approximate by design; full-width ones are the stored bits
            assert result.output_token_ids == reader.generate(prompt, 8, mode="baseline").output_token_ids


def test_a_context_streamed_from_host_memory_over_a_narrow_cache_gives_the_resident_tokens(tokenizer, device):
    model = make_tiny_model("llama", tokenizer, device=device)
    prompt = text_with_tokens(tokenizer, 5 * CHUNK, seed=7)
    resident = KVBoost(model, tokenizer, chunk_size=CHUNK, kv_dtype="bfloat16")
    streamed = KVBoost(model, tokenizer, chunk_size=CHUNK, kv_dtype="bfloat16", device_kv_max_tokens=2 * CHUNK)
    assert streamed.generate(prompt, 8).output_token_ids == resident.generate(prompt, 8).output_token_ids
    assert streamed.cache_stats()["streamed"]["forwards"] > 0
