"""model/int4/head.py: Int8Head computes x @ W^T within int8 rounding of W's rows and bfloat16 activations;
quantize_head swaps a CPU model's float head only, keeping a tied input embedding float."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvboost.model.int4.head import Int8Head, quantize_head

from ...tiny_models import make_tiny_model


@pytest.mark.parametrize("rows", [1, 5])
def test_int8_head_matches_the_float_product(rows):
    torch.manual_seed(rows)
    weight = torch.randn(1000, 64) * torch.rand(1000, 1)  # rows of different ranges: one scale each
    head = Int8Head(weight)
    x = torch.randn(2, rows, 64)
    with torch.inference_mode():
        got = head(x)
    want = F.linear(x, weight)
    assert got.shape == want.shape and got.dtype == torch.float32
    # per row: half a step (the row's range / 127, rounded up to a bfloat16 scale: at most 2^-7 more) at most
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert (head.scales.float()[:, None] >= step).all() and (head.scales.float()[:, None] <= step * (1 + 2**-7)).all()
    codes_times_scales = head.codes.float() * head.scales.float()[:, None]
    assert ((codes_times_scales - weight).abs() <= 0.5 * step * (1 + 2**-7) * 1.0001).all()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.9999


def test_a_zero_row_gets_a_usable_scale():
    weight = torch.zeros(4, 32)
    weight[1] = 1.0
    with torch.inference_mode():
        out = Int8Head(weight)(torch.ones(1, 32))
    assert torch.isfinite(out).all() and out[0, 0] == 0 and out[0, 1] == pytest.approx(32, rel=1e-2)


def test_quantize_head_swaps_the_head_and_keeps_the_tied_embedding(tokenizer):
    model = make_tiny_model("llama", tokenizer, device="cpu")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    embedding = model.get_input_embeddings().weight.detach().clone()
    ids = torch.tensor([[5, 9, 11, 42]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        assert quantize_head(model)
        after = model(input_ids=ids).logits
    assert isinstance(model.get_output_embeddings(), Int8Head)
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    assert torch.nn.functional.cosine_similarity(after.flatten(), before.flatten(), dim=0) > 0.999
    assert not quantize_head(model)  # already quantized: nothing to swap


def test_int8_head_refuses_a_gpu_weight():
    with pytest.raises(ValueError, match="runs on the CPU"):
        Int8Head(torch.zeros(4, 8, device="meta"))
