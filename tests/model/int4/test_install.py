"""model/int4/install.py: q/k/v and gate/up become one fused INT4 layer each, and the model computes exactly what the
separate INT4 layers compute, on every tiny architecture (phi3 already fuses its own) and in the engine."""
from __future__ import annotations

import pytest
import torch

from kvboost import KVBoost
from kvboost.model.int4.install import SiblingOutput, install_int4, quantize_linears
from kvboost.model.int4.linear import Int4Linear, replace_linear
from kvboost.model.int4.weights import Int4Weights
from tests.tiny_models import TINY_ARCHS, make_tiny_model


def _quantized(arch: str, tokenizer, fused: bool, device: torch.device | str = "cpu"):
    """The tiny model with INT4 layers laid out for `device` (moved there), fused or each on its own."""
    model = make_tiny_model(arch, tokenizer, device="cpu")
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    layers = [(n, Int4Weights.quantize_rtn(model.get_submodule(n).weight, 32)) for n in names]
    if fused:
        assert install_int4(model, iter(layers), device) == len(names)
    else:
        for name, weights in layers:
            replace_linear(model, name, weights, device)
    return model.to(device)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_fused_siblings_compute_the_separate_layers_bit_for_bit(tokenizer, arch):
    separate, fused = _quantized(arch, tokenizer, False), _quantized(arch, tokenizer, True)
    n_layers = separate.config.num_hidden_layers
    siblings = [m for m in fused.modules() if isinstance(m, SiblingOutput)]
    if arch == "phi3":  # qkv_proj and gate_up_proj are fused by the architecture itself
        assert siblings == []
    else:
        assert len(siblings) == 5 * n_layers
        assert sum(isinstance(m, Int4Linear) for m in fused.modules()) == 4 * n_layers  # qkv, o, gate/up, down
    # each fused layer is in the state dict once, under the first sibling
    assert not any(".k_proj." in k or ".up_proj." in k for k in fused.state_dict())
    ids = torch.tensor([[5, 9, 11, 300, 42, 7]])
    with torch.inference_mode():
        assert torch.equal(fused(input_ids=ids).logits, separate(input_ids=ids).logits)
        for name, module in separate.named_modules():  # and each projection alone, called on its own
            if isinstance(module, Int4Linear):
                x = torch.randn(2, 3, module.in_features)
                assert torch.equal(fused.get_submodule(name)(x), module(x)), name


def test_fused_siblings_on_the_suite_s_device(tokenizer, device):
    """The device's own kernel (on CUDA torch's int4 mm, or Triton): the fused model's logits are the separate one's
    (bit for bit on the CPU; on CUDA the kernels may tile the wider matrix differently, so within float32 rounding)."""
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    separate, fused = _quantized("qwen2", tokenizer, False, device), _quantized("qwen2", tokenizer, True, device)
    ids = torch.tensor([[5, 9, 11, 300, 42, 7]], device=device)
    with torch.inference_mode():
        got, want = fused(input_ids=ids).logits, separate(input_ids=ids).logits
    if device.type == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_sibling_holds_nothing_once_every_sibling_has_read(tokenizer):
    model = _quantized("llama", tokenizer, True)
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 2, attn.q_proj.in_features)
    q = attn.q_proj(x)
    k_first = attn.k_proj(x)
    shared = attn.q_proj.fused
    # a new input recomputes, never serves the old result
    y = torch.randn_like(x)
    assert torch.equal(attn.k_proj(y), shared(y)[..., q.shape[-1]:q.shape[-1] + k_first.shape[-1]])
    assert not torch.equal(attn.k_proj(y), k_first)
    attn.q_proj(y), attn.v_proj(y)
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert m(y).shape[-1] == m.out_features


def test_siblings_that_cannot_fuse_stay_separate(tokenizer):
    model = make_tiny_model("llama", tokenizer, device="cpu")
    attn = model.model.layers[0].self_attn
    weights = {n: Int4Weights.quantize_rtn(getattr(attn, n).weight, 64 if n == "v_proj" else 32)
               for n in ("q_proj", "k_proj", "v_proj")}  # v in other groups than q and k
    install_int4(model, ((f"model.layers.0.self_attn.{n}", w) for n, w in weights.items()))
    assert all(isinstance(getattr(attn, n), Int4Linear) for n in weights)
    wrong = Int4Weights.quantize_rtn(torch.randn(attn.o_proj.out_features + 32, attn.o_proj.in_features), 32)
    with pytest.raises(ValueError, match="expected an nn.Linear"):
        install_int4(model, [("model.layers.0.self_attn.o_proj", wrong)])


def test_a_fused_int4_model_generates_as_the_separate_one(tokenizer):
    outputs = []
    for fused in (False, True):
        engine = KVBoost(_quantized("qwen2", tokenizer, fused), tokenizer, device="cpu", fast_path="off")
        single = engine.generate("Hello there, how are", max_new_tokens=8).output_token_ids
        batch = [r.output_token_ids for r in engine.generate_batch(["One two", "Three four five"], max_new_tokens=6)]
        outputs.append((single, batch))
    assert outputs[0] == outputs[1]


def test_a_fused_model_pickles_with_its_layers_shared(tokenizer, tmp_path):
    """The decode-step package's build reads the model from a pickle (model/aot_build.py)."""
    model = _quantized("llama", tokenizer, True)
    ids = torch.tensor([[5, 9, 11, 300, 42, 7]])
    with torch.inference_mode():
        want = model(input_ids=ids).logits
    torch.save(model, tmp_path / "model.pt")
    again = torch.load(tmp_path / "model.pt", weights_only=False)
    attn = again.model.layers[1].self_attn
    assert attn.k_proj.layer is attn.q_proj.fused and attn.v_proj.layer is attn.q_proj.fused
    with torch.inference_mode():
        assert torch.equal(again(input_ids=ids).logits, want)


def test_quantize_linears_spares_the_head_and_keeps_the_model_close(tokenizer):
    model = make_tiny_model("llama", tokenizer, device="cpu")
    ids = torch.tensor([[5, 9, 11, 300, 42, 7]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    n = quantize_linears(model, group=32)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert n > 0 and [type(m) for m in linears] == [torch.nn.Linear]  # the head only
    fused = [m.fused for m in model.modules() if isinstance(m, SiblingOutput) and m.index == 0]
    projections = [m for m in model.modules() if isinstance(m, (Int4Linear, SiblingOutput)) and m not in fused]
    assert len(projections) == n
    with torch.inference_mode():
        after = model(input_ids=ids).logits
    # 4-bit codes of random weights in 32-wide groups: close, not equal (the layers' exactness is tested above)
    assert torch.nn.functional.cosine_similarity(after.flatten(), before.flatten(), dim=0) > 0.95
