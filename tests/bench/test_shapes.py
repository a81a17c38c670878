"""Random-weight shapes of real architectures (bench/shapes.py): the published numbers, checked without weights."""
from __future__ import annotations

import pytest
import torch

from benchmarks.shapes import (
    SHAPES,
    UnknownShapeError,
    build_shape_model,
    parameter_count,
    resolve_dtype,
    shape_config,
)

# From each checkpoint's published config.json: layers, hidden, intermediate, heads, KV heads, head dim, vocab,
# context, tied embeddings, RoPE theta.
PUBLISHED = {
    "qwen2.5-0.5b": (24, 896, 4864, 14, 2, 64, 151936, 32768, True, 1e6),
    "qwen2.5-3b": (36, 2048, 11008, 16, 2, 128, 151936, 32768, True, 1e6),
    "llama-3.1-8b": (32, 4096, 14336, 32, 8, 128, 128256, 131072, False, 500000.0),
    "smollm2-135m": (30, 576, 1536, 9, 3, 64, 49152, 8192, True, 100000.0),
}
# Parameter counts the checkpoints publish (Qwen2.5-3B: 3.09B, Llama-3.1-8B: 8.03B ...), with their own vocab.
PUBLISHED_PARAMS = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-3b": 3_085_938_688, "llama-3.1-8b": 8_030_261_248,
                    "smollm2-135m": 134_515_008}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_config_has_the_published_numbers(name):
    layers, hidden, inter, heads, kv_heads, head_dim, vocab, context, tied, theta = PUBLISHED[name]
    cfg = shape_config(name)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (layers, hidden, inter)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (heads, kv_heads)
    assert (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads) == head_dim
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (vocab, context, tied)
    assert cfg.rope_parameters["rope_theta"] == theta
    assert SHAPES[name].description


def test_llama31_uses_llama3_rope_scaling():
    rope = shape_config("llama-3.1-8b").rope_parameters
    assert rope["rope_type"] == "llama3"
    assert (rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]) == (8.0, 1.0, 4.0)
    assert rope["original_max_position_embeddings"] == 8192


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_count_matches_the_checkpoint(name):
    assert parameter_count(name) == PUBLISHED_PARAMS[name]  # counted on the meta device: nothing allocated


def test_build_on_meta_takes_the_tokenizer_vocab_and_keeps_the_shape(tokenizer):
    model, tok = build_shape_model("qwen2.5-3b", "meta", "bfloat16", tokenizer=tokenizer)
    p = next(model.parameters())
    assert p.device.type == "meta" and p.dtype == torch.bfloat16  # built in place, never fp32 on the host
    assert model.get_input_embeddings().weight.shape == (len(tokenizer), 2048)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied, as the real model
    assert len(model.model.layers) == 36
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.out_features, attn.k_proj.out_features) == (16 * 128, 2 * 128)
    assert attn.q_proj.bias is not None  # Qwen2's QKV bias
    assert model.config.eos_token_id == tokenizer.eos_token_id


def test_unknown_shape_lists_the_known_ones():
    with pytest.raises(UnknownShapeError, match="qwen2.5-3b") as err:
        shape_config("qwen9")
    assert all(name in str(err.value) for name in SHAPES)


def test_auto_dtype_is_fp32_on_cpu_and_bf16_on_a_gpu():
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("fp16", torch.device("cpu")) == torch.float16


def test_tiny_builds_deterministically_and_generates(tokenizer, device):
    from kvboost import KVBoost

    model, tok = build_shape_model("tiny", device, "float32", seed=0, tokenizer=tokenizer)
    assert next(model.parameters()).device.type == device.type
    again, _ = build_shape_model("tiny", device, "float32", seed=0, tokenizer=tokenizer)
    other, _ = build_shape_model("tiny", device, "float32", seed=1, tokenizer=tokenizer)
    w = model.model.layers[0].self_attn.q_proj.weight.detach()
    assert torch.equal(w, again.model.layers[0].self_attn.q_proj.weight)
    assert not torch.equal(w, other.model.layers[0].self_attn.q_proj.weight)
    assert 0.01 < float(w.std()) < 0.03  # small std: finite logits, attention not saturated
    ids = torch.tensor([tok("The quick brown fox jumps over the lazy dog")["input_ids"]], device=device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0]
    assert torch.isfinite(logits).all()
    assert len(set(logits.argmax(-1).tolist())) > 1  # positions disagree: not a degenerate model
    result = KVBoost(model, tok).generate("Hello there", max_new_tokens=4)
    assert 1 <= result.generated_tokens <= 4


def test_bf16_is_built_in_bf16(tokenizer):
    model, _ = build_shape_model("tiny", "cpu", "bf16", tokenizer=tokenizer)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_a_random_int4_shape_never_holds_a_float_decoder_weight(tokenizer, device, monkeypatch):
    """The 32B shape's INT4 rows draw their codes on the device: no float weight of a decoder Linear is ever made
    (recorded here: every nn.Linear built is on the meta device), every tensor is real, and the model generates."""
    import torch

    from benchmarks.shapes import build_int4_shape_model
    from kvboost import KVBoost
    from kvboost.model.int4.linear import Int4Linear

    made = []
    original = torch.nn.Linear.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self.weight.device.type)

    monkeypatch.setattr(torch.nn.Linear, "__init__", record)
    dtype = "float32" if device.type == "cpu" else "bfloat16"
    model, tok = build_int4_shape_model("tiny", device, dtype, tokenizer, group=32)
    assert made and set(made) == {"meta"}
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 4 * 2  # fused q/k/v, o, fused gate/up, down in each of 2 layers
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as the shape's config says
    out = KVBoost(model, tok, fast_path="off").generate("hello there", max_new_tokens=4)
    assert len(out.output_token_ids) == 4
