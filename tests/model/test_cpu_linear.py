"""model/cpu_linear.py: Linear layers over few token rows as W @ x^T on a CPU, installed on the model's modules."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvboost import KVBoost
from kvboost.config import EngineConfig
from kvboost.model.cpu_linear import install_cpu_linear, model_own_products, uninstall_cpu_linear, uses_w_x

from ..tiny_models import make_tiny_model

needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="the W @ x^T products apply with MKL only")


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


def _cpu_only(device: torch.device) -> None:
    # The products apply to CPU models only (cpu_linear_reason); these tests build theirs on the suite's device.
    if device.type != "cpu":
        pytest.skip(f"W @ x^T are CPU BLAS products: the models are on {device.type}")


def _not_on_cpu(device: torch.device) -> str:
    """What cpu_linear_reason says of a model on `device` (not the CPU)."""
    return f"the model is on {device.type} (CPU BLAS only)"


@needs_mkl
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2's q/k/v carry a bias
def test_few_rows_are_w_times_x_transposed_and_others_untouched(arch, threads, tokenizer, device):
    _cpu_only(device)
    model = make_tiny_model(arch, tokenizer)
    reason = install_cpu_linear("auto", model)
    assert reason.startswith("W @ x^T") and f"{len(_linears(model))} Linear" in reason
    gen = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for layer in _linears(model)[:4]:
            for rows in (1, 2, 5, 8, 9, 10, 16):
                x = torch.randn(1, rows, layer.in_features, generator=gen)
                with torch.inference_mode():
                    got = layer(x)
                own = F.linear(x, layer.weight, layer.bias)
                assert got.shape == own.shape and got.is_contiguous()
                if uses_w_x(rows):
                    assert rows in (range(1, 10) if threads > 1 else range(2, 5))
                    cols = x[0] if rows > 1 else torch.cat((x[0], x[0]))  # one row: two equal columns, the first kept
                    want = (layer.weight @ cols.T).T[:rows]
                    if layer.bias is not None:
                        want = want + layer.bias
                    assert torch.equal(got[0], want)
                    torch.testing.assert_close(got, own, rtol=1e-5, atol=1e-5)  # another summation order only
                else:  # one row at one thread, and longer forwards: the model's own products, bit for bit
                    assert torch.equal(got, own)
    finally:
        torch.set_num_threads(before)


@needs_mkl
def test_an_input_major_weight_keeps_the_models_own_product(tokenizer, device):
    """A weight stored input-major (same values, strides (1, out)) computes F.linear, bit for bit, at every row count:
    W @ x^T over that order measured 4-15x slower."""
    _cpu_only(device)
    model = make_tiny_model("llama", tokenizer)
    install_cpu_linear("auto", model)
    layer = _linears(model)[0]
    layer.weight.data = layer.weight.data.t().contiguous().t()
    assert not layer.weight.is_contiguous()
    with torch.inference_mode():
        for rows in (1, 2, 4, 9):
            x = torch.randn(rows, layer.in_features)
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias)), rows


def test_training_and_other_dtypes_keep_the_models_own_products(tokenizer, device):
    _cpu_only(device)
    model = make_tiny_model("llama", tokenizer)
    install_cpu_linear("auto", model)
    layer = _linears(model)[0]
    x = torch.randn(4, layer.in_features, requires_grad=True)
    out = layer(x)  # grad enabled and needed: F.linear, differentiable as before
    out.sum().backward()
    assert x.grad is not None and torch.equal(out, F.linear(x, layer.weight, layer.bias))
    with torch.inference_mode():
        half = torch.randn(4, layer.in_features, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError):  # dtype mismatch fails exactly as nn.Linear does, not silently
            layer(half)


def test_modes(tokenizer, device):
    model = make_tiny_model("llama", tokenizer)
    with pytest.raises(ValueError, match="cpu_linear must be one of auto, on, off"):
        EngineConfig(cpu_linear="yes")
    if device.type != "cpu":  # the device is checked first: "on" is refused for any model there, "auto" is off
        reason = re.escape(_not_on_cpu(device))
        with pytest.raises(ValueError, match=f"cpu_linear='on': {reason}"):
            KVBoost(model, tokenizer, cpu_linear="on")
        assert install_cpu_linear("auto", model) == f"off: {_not_on_cpu(device)}"
        assert all("forward" not in vars(m) for m in _linears(model))
        return
    bf16 = make_tiny_model("llama", tokenizer).to(torch.bfloat16)
    with pytest.raises(ValueError, match="cpu_linear='on': the model is bfloat16"):
        KVBoost(bf16, tokenizer, cpu_linear="on")
    assert install_cpu_linear("auto", bf16).startswith("off: the model is bfloat16")
    assert all("forward" not in vars(m) for m in _linears(bf16))
    if torch.backends.mkl.is_available():
        install_cpu_linear("auto", model)
        assert all("forward" in vars(m) for m in _linears(model))
        install_cpu_linear("auto", model)  # idempotent: a second engine on the same model
        assert install_cpu_linear("off", model) == "off"
        assert all("forward" not in vars(m) for m in _linears(model))


@needs_mkl
def test_model_own_products_suspends_and_restores(tokenizer, device):
    _cpu_only(device)
    model = make_tiny_model("llama", tokenizer)
    install_cpu_linear("on", model)
    layer = _linears(model)[0]
    x = torch.randn(3, layer.in_features)
    with torch.inference_mode():
        with model_own_products(model):
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        assert torch.equal(layer(x), (layer.weight @ x.T).T)
    uninstall_cpu_linear(model)
    with model_own_products(model):  # nothing installed: nothing to restore
        pass
    assert all("forward" not in vars(m) for m in _linears(model))


@needs_mkl
def test_engine_reports_it_and_outputs_stay_greedy_exact(tokenizer, device):
    """Batched rows and verifies go through the few-row form; their tokens equal one-at-a-time greedy."""
    _cpu_only(device)
    model = make_tiny_model("llama", tokenizer)
    engine = KVBoost(model, tokenizer, chunk_size=16)
    assert engine.cache_stats()["fast_path"]["cpu_linear"].startswith("W @ x^T")
    prompts = ["the cat sat on the mat", "a b c d e f g", "one two three four", "red green blue"]
    singles = [engine.generate(p, 12).output_token_ids for p in prompts]
    batched = [r.output_token_ids for r in engine.generate_batch(prompts, max_new_tokens=12)]
    assert batched == singles
    off = KVBoost(model, tokenizer, chunk_size=16, cpu_linear="off")
    assert off.cache_stats()["fast_path"]["cpu_linear"] == "off"
    assert [off.generate(p, 12).output_token_ids for p in prompts] == singles


def test_an_engine_off_the_cpu_reports_it_off_and_refuses_on(tokenizer, device):
    """On another device the engine keeps the model's own products and says why; "on" is refused there."""
    if device.type == "cpu":
        pytest.skip("the engine on a CPU model: test_engine_reports_it_and_outputs_stay_greedy_exact")
    model = make_tiny_model("llama", tokenizer)
    engine = KVBoost(model, tokenizer, chunk_size=16)
    assert engine.cache_stats()["fast_path"]["cpu_linear"] == f"off: {_not_on_cpu(device)}"
    assert all("forward" not in vars(m) for m in _linears(model))
    with pytest.raises(ValueError, match=re.escape(_not_on_cpu(device))):
        KVBoost(model, tokenizer, chunk_size=16, cpu_linear="on")
