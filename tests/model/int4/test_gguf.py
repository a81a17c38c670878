"""model/int4/gguf.py on the embedded SmolLM2 (slow): every Q4_1 Linear of the shipped GGUF becomes an Int4Linear of its
stored codes, computing what transformers' own dequantization of the file (the converted float model) computes,
q/k rows in transformers' order; `from_pretrained(weights="int4")` builds it without float layers (int8 head) and
serves it under its own cache namespace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvboost import KVBoost
from kvboost.loading import cache_root, embedded_gguf_path, load_model_and_tokenizer
from kvboost.model.int4.gguf import int4_linears_from_gguf
from kvboost.model.int4.head import Int8Head, quantize_head
from kvboost.model.int4.linear import Int4Linear

pytestmark = pytest.mark.slow


def test_every_q4_linear_computes_transformers_dequantization(smol_dir, tmp_path):
    model, _ = load_model_and_tokenizer(str(smol_dir), device="cpu")
    floats = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    # 30 layers x q, k, v, o, gate, up, down, decoded from the file into an empty cache
    assert int4_linears_from_gguf(model, embedded_gguf_path(), cache_dir=tmp_path) == 210
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    torch.manual_seed(0)
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 120  # q/k/v and gate/up fused: 4 per layer
    for name, weight in floats.items():
        if name == "lm_head":
            continue
        module = model.get_submodule(name)  # an Int4Linear, or a sibling's columns of a fused one
        x = torch.randn(3, weight.shape[1])
        with torch.inference_mode():
            got, want = module(x), F.linear(x, weight)
        # bfloat16 activations and scales; a row out of place (a wrong q/k permutation) would be far off
        assert (got - want).abs().max() <= 0.03 * want.abs().max(), name
    assert isinstance(model.lm_head, torch.nn.Linear)  # the Q8_0 embedding / tied head stays float
    ids = torch.tensor([[5, 9, 11, 300, 42]])
    with torch.inference_mode():
        decoded = model(input_ids=ids).logits
    for cache in (True, False):  # from the cache file; then from the file again, the cache being unreadable
        again, _ = load_model_and_tokenizer(str(smol_dir), device="cpu")
        if not cache:
            next(tmp_path.glob("*.safetensors")).write_bytes(b"not safetensors")
        assert int4_linears_from_gguf(again, embedded_gguf_path(), cache_dir=tmp_path) == 210
        with torch.inference_mode():
            assert torch.equal(again(input_ids=ids).logits, decoded)
    assert not list(tmp_path.glob("*.partial"))


def test_from_pretrained_int4_serves_under_its_own_namespace(smol):
    with pytest.raises(ValueError, match="weights must be one of"):
        KVBoost.from_pretrained(weights="int3", device="cpu")
    with pytest.raises(ValueError, match="run on cpu or cuda"):
        KVBoost.from_pretrained(weights="int4", device="meta")
    q4 = KVBoost.from_pretrained(weights="int4", device="cpu")
    fp = KVBoost(*smol, device="cpu")
    assert sum(isinstance(m, Int4Linear) for m in q4.model.modules()) == 120  # 210 projections, siblings fused
    assert isinstance(q4.model.get_output_embeddings(), Int8Head)
    # Built without its float layers (model_from_gguf): the model the float conversion gives once converted alike
    converted, _ = load_model_and_tokenizer(device="cpu")
    int4_linears_from_gguf(converted, embedded_gguf_path(), cache_root() / "int4")
    quantize_head(converted)
    ids = torch.tensor([[5, 9, 11, 300, 42, 1000, 7]])
    with torch.inference_mode():
        assert torch.equal(q4.model(input_ids=ids).logits, converted(input_ids=ids).logits)
    assert not [n for n, p in q4.model.named_parameters() if p.device.type != "cpu"]
    assert q4.fingerprint != fp.fingerprint  # K/V of one never serves the other
    out = q4.generate("The capital of France is", max_new_tokens=8)
    assert out.generated_tokens == 8 and out.text.strip()
    again = q4.generate("The capital of France is", max_new_tokens=8)
    assert again.cached_tokens > 0 and again.output_token_ids == out.output_token_ids
