"""model/int4/linear.py: Int4Linear computes x @ W^T (+ b) for the dequantized W on every shape class the models use,
within bfloat16 rounding of the activations; swapping a layer checks its shape."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvboost import KVBoost
from kvboost.model.int4.install import quantize_linears
from kvboost.model.int4.linear import Int4Linear, replace_linear
from kvboost.model.int4.weights import Int4Weights

from ...tiny_models import make_tiny_model


@pytest.mark.parametrize("out_features,in_features", [(576, 576), (192, 576), (1536, 576), (576, 1536), (64, 32)])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_int4_linear_matches_the_dequantized_product(device, out_features, in_features, rows):
    torch.manual_seed(rows)
    group = 32 if in_features % 128 else 128
    weights = Int4Weights.quantize_rtn(torch.randn(out_features, in_features) * 0.05, group)
    bias = torch.randn(out_features)
    x = torch.randn(2, rows, in_features, device=device)
    want = F.linear(x, weights.dequantize().to(device), bias.to(device))
    kernels = ("triton", "tinygemm") if device.type == "cuda" else ("cpu",)
    for kernel in kernels:  # built from host memory for the device, then moved there
        layer = Int4Linear(weights, bias, device=device, kernel=kernel).to(device)
        with torch.inference_mode():
            got = layer(x)
        assert got.shape == want.shape and got.dtype == torch.float32
        # bfloat16 activations (cpu, tinygemm) or fp32 (triton): ~3 significant digits per product at worst
        assert (got - want).abs().max() <= 0.02 * want.abs().max(), kernel
        assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.9999, kernel


def test_a_layer_built_for_cuda_waits_in_host_memory_and_runs_only_there(tokenizer):
    from kvboost.model.attention.support import triton_available

    if not triton_available():
        pytest.skip("without a GPU the CUDA layout is the Triton kernel's (pip install 'kvboost[gpu]')")
    model = make_tiny_model("llama", tokenizer, device="cpu")
    quantize_linears(model, group=32, device="cuda")
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    kernel = "tinygemm" if torch.cuda.is_available() else "triton"  # torch's lays its codes out on a GPU
    assert layers and all(m.device_type == "cuda" and m.kernel == kernel for m in layers)
    assert {b.device.type for m in layers for b in m.buffers()} == {"cpu"}  # until the model moves
    with pytest.raises(ValueError, match="laid out for cuda"):
        layers[0](torch.randn(2, layers[0].in_features))
    with pytest.raises(ValueError, match="INT4 layers are laid out for cuda and the engine runs on cpu"):
        KVBoost(model, tokenizer, device="cpu")


def test_kernels_refuse_what_they_cannot_lay_out():
    weights = Int4Weights.quantize_rtn(torch.randn(36, 64), 32)
    with pytest.raises(ValueError, match="outputs a multiple of 8"):
        Int4Linear(weights, device="cuda", kernel="tinygemm")
    with pytest.raises(ValueError, match="kernel 'triton' does not run on cpu"):
        Int4Linear(weights, kernel="triton")
    with pytest.raises(ValueError, match="kernel 'cpu' does not run on cuda"):
        Int4Linear(weights, device="cuda", kernel="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="none is available"):
            Int4Linear(Int4Weights.quantize_rtn(torch.randn(32, 64), 32), device="cuda", kernel="tinygemm")


def test_replace_linear_checks_the_layer(tokenizer):
    model = make_tiny_model("llama", tokenizer, device="cpu")
    proj = model.model.layers[0].self_attn.q_proj
    wrong = Int4Weights.quantize_rtn(torch.randn(proj.out_features + 32, proj.in_features), 32)
    with pytest.raises(ValueError, match="expected an nn.Linear"):
        replace_linear(model, "model.layers.0.self_attn.q_proj", wrong)
    replace_linear(model, "model.layers.0.self_attn.q_proj", Int4Weights.quantize_rtn(proj.weight, 32))
    assert isinstance(model.model.layers[0].self_attn.q_proj, Int4Linear)
    with pytest.raises(ValueError, match="expected an nn.Linear"):  # already swapped
        replace_linear(model, "model.layers.0.self_attn.q_proj", Int4Weights.quantize_rtn(proj.weight, 32))


def test_an_int4_model_runs_in_the_engine_and_refuses_the_compiled_path(tokenizer):
    model = make_tiny_model("llama", tokenizer, device="cpu")
    quantize_linears(model, group=32)
    with pytest.raises(ValueError, match="compiles float weights; this model's layers are int4-g32"):
        KVBoost(model, tokenizer, device="cpu", fast_path="compiled")
    engine = KVBoost(model, tokenizer, device="cpu")  # the decode-step package of INT4 layers: test_aot_step.py
    first = engine.generate("Hello there, how are", max_new_tokens=6)
    again = engine.generate("Hello there, how are", max_new_tokens=6)
    assert again.cached_tokens > 0 and again.output_token_ids == first.output_token_ids
