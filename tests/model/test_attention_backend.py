"""Backend selection, the SDPA fallback (cuDNN excluded), import without triton, and the
transformers wiring: a tiny model's logits inside `kvboost_attention(model)` equal its own implementation's."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from transformers import DynamicCache

from kvboost.model.attention import (
    FALLBACK_BACKENDS,
    KernelUnsupportedError,
    attention,
    backend,
    kvboost_attention,
    reference_attention,
    sdpa_attention,
    select_backend,
)
from kvboost.model.cache_arg import cache_kwargs

from ..tiny_models import make_tiny_model


# ---- selection ---------------------------------------------------------------------------------------------------
def test_select_backend_reasons(monkeypatch):
    assert select_backend("cpu", torch.float32, 64)[0] == "sdpa"
    assert "CUDA" in select_backend("cpu", torch.float32, 64)[1]
    assert select_backend("cuda", torch.bfloat16, 128, prefer="sdpa") == ("sdpa", "sdpa requested")
    assert select_backend("cuda", torch.float64, 128)[0] == "sdpa"
    assert select_backend("cuda", torch.float16, 512)[0] == "sdpa"
    assert select_backend("cuda", torch.float16, 192, head_dim_v=128)[0] == "sdpa"  # MLA-style split dims
    if backend.triton_available():  # selection reads the device type only: no GPU needed to ask
        assert select_backend("cuda", torch.float16, 80)[0] == "triton"
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    backend._select.cache_clear()
    try:
        choice, why = select_backend("cuda", torch.float16, 128)
        assert choice == "sdpa" and "not installed" in why
        with pytest.raises(KernelUnsupportedError, match="not installed"):
            attention(*torch.randn(3, 1, 2, 4, 16), backend="triton")
    finally:
        backend._select.cache_clear()


# ---- the fallback ------------------------------------------------------------------------------------------------
def test_fallback_excludes_cudnn(monkeypatch):
    assert SDPBackend.CUDNN_ATTENTION not in FALLBACK_BACKENDS
    assert set(FALLBACK_BACKENDS) == {SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH}
    seen = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
                     torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    q, k, v = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    sdpa_attention(q, k, v, scale=0.25)  # explicit bottom-right mask
    sdpa_attention(q[:, :, :1], k, v, scale=0.25)  # q == 1: no mask
    assert seen == [(False, True, True, True)] * 2
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


@pytest.mark.parametrize("kw", [dict(), dict(kv_len=20), dict(ends=torch.tensor([30, 11])),
                                dict(key_valid=torch.arange(30)[None, :].expand(2, 30) % 7 != 3)])
def test_sdpa_fallback_matches_reference(device, kw):
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    q, k, v = (torch.randn(2, h, s, 24, device=device) for h, s in ((6, 13), (2, 30), (2, 30)))
    out = sdpa_attention(q, k, v, scale=0.2, **kw)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, scale=0.2, **kw), atol=2e-5, rtol=2e-5)


def test_attention_past_reads_only_the_valid_length(device):
    q, k, v = torch.randn(1, 2, 4, 32, device=device), torch.randn(1, 2, 50, 32, device=device), \
        torch.randn(1, 2, 50, 32, device=device)
    k[:, :, 10:], v[:, :, 10:] = float("nan"), float("nan")
    out = attention(q, k, v, past=6)
    torch.testing.assert_close(out.double(), reference_attention(q, k[:, :, :10], v[:, :, :10], scale=32 ** -0.5),
                               atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="past"):
        attention(q, k, v, past=47)


def test_package_imports_and_runs_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"  # `import triton` now raises ImportError
            "import torch\n"
            "from kvboost.model.attention import attention, select_backend, triton_available, kvboost_attention\n"
            "assert not triton_available()\n"
            "assert select_backend('cuda', torch.float16, 128)[0] == 'sdpa'\n"
            "q = torch.randn(1, 2, 3, 16)\n"
            "print(tuple(attention(q, q, q).shape))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "(1, 2, 3, 16)"


# ---- transformers wiring -------------------------------------------------------------------------------------------
def _run(model, chunks, attention_mask=None, wrap=None):
    """Feed `chunks` ([B, n] id tensors) one after another over one DynamicCache; returns every chunk's logits."""
    cache = DynamicCache(config=model.config)
    outs, seen = [], 0
    with torch.inference_mode():
        for ids in chunks:
            seen += ids.shape[1]
            kw = {} if attention_mask is None else {"attention_mask": attention_mask[:, :seen]}
            if wrap is None:
                outs.append(model(input_ids=ids, **cache_kwargs(cache), use_cache=True, **kw).logits)
            else:
                with wrap:
                    outs.append(model(input_ids=ids, **cache_kwargs(cache), use_cache=True, **kw).logits)
    return outs


def _chunks(model, sizes, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 2000, (batch, n), generator=g).to(model.device) for n in sizes]


@pytest.fixture(scope="module")
def llama(tokenizer, device):
    return make_tiny_model("llama", tokenizer, device=device)


def _same(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-5)


def test_tiny_llama_logits_match_sdpa_over_a_cache(llama, device):
    model = llama
    chunks = _chunks(model, [37, 9, 1, 1])  # prefill, a suffix over the cache (q < kv), two decode steps
    expected = _run(model, chunks)
    with kvboost_attention(model) as ctx:
        got = _run(model, chunks)
    _same(got, expected)
    if device.type == "cpu":  # the fallback makes the same SDPA calls as transformers' sdpa here: bit-identical
        assert all(torch.equal(x, y) for x, y in zip(got, expected))
    assert ctx.counts == {"triton" if device.type == "cuda" and backend.triton_available() else "sdpa": 12}
    assert model.config._attn_implementation == "sdpa"  # restored


def test_tiny_llama_logits_match_with_the_kernel(llama, kernel_device):
    model = llama
    chunks = _chunks(model, [37, 9, 1])
    expected = _run(model, chunks)
    with kvboost_attention(model, backend="triton") as ctx:
        got = _run(model, chunks)
    _same(got, expected)
    assert ctx.counts == {"triton": 9}


@pytest.mark.parametrize("prefer", [None, "triton"])
def test_left_padded_batch_uses_the_padding_vector(llama, device, prefer, request):
    # Row 1 is left-padded by 5: the 2D mask reaches kvboost_mask, which records the padding vector, so the
    # backend runs with key_valid (no "sdpa:mask" fallback) and padded keys stay invisible in later steps.
    if prefer == "triton":
        request.getfixturevalue("kernel_device")
    model = llama
    chunks = _chunks(model, [20, 6, 1], batch=2, seed=1)
    mask = torch.ones(2, 27, dtype=torch.long, device=device)
    mask[1, :5] = 0
    expected = _run(model, chunks, mask)
    with kvboost_attention(model, backend=prefer) as ctx:
        got = _run(model, chunks, mask)
    for n, (x, y) in enumerate(zip(got, expected)):
        skip = 5 if n == 0 else 0  # row 1's padded query positions: nobody reads their outputs
        torch.testing.assert_close(x[0], y[0], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(x[1, skip:], y[1, skip:], atol=2e-5, rtol=1e-5)
    assert set(ctx.counts) == {prefer or ("triton" if device.type == "cuda" and backend.triton_available()
                                          else "sdpa")} and ctx.calls == 9


@pytest.mark.parametrize("arch,path", [("gemma2", "eager:softcap"), ("gemma3", "sdpa:sliding_window")])
def test_softcap_and_sliding_window_take_the_explicit_fallback(tokenizer, device, arch, path):
    model = make_tiny_model(arch, tokenizer, device=device)
    chunks = _chunks(model, [60, 7, 1])  # longer than the window (48): the sliding masks matter
    expected = _run(model, chunks)
    with kvboost_attention(model) as ctx:
        got = _run(model, chunks)
    _same(got, expected)
    assert ctx.counts[path] > 0
    if arch == "gemma3":  # its full-attention layer still runs the bottom-right backend
        assert ctx.counts["sdpa:sliding_window"] == 6 and ctx.calls == 9


def test_foreign_mask_goes_to_sdpa_with_the_mask(device):
    from kvboost.model.attention.hf import kvboost_attention_forward

    module = torch.nn.Module().eval()
    q, k, v = torch.randn(1, 4, 3, 16, device=device), torch.randn(1, 2, 8, 16, device=device), \
        torch.randn(1, 2, 8, 16, device=device)
    mask = torch.rand(1, 1, 3, 8, device=device) > 0.3
    mask[..., 0] = True
    with kvboost_attention(torch.nn.Linear(1, 1)) as ctx:
        out, _ = kvboost_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert ctx.counts == {"sdpa:mask": 1}
    ref = torch.softmax((q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf")), -1)
    torch.testing.assert_close(out, (ref @ v.repeat_interleave(2, 1)).transpose(1, 2), atol=2e-5, rtol=1e-5)


def test_config_restored_when_the_block_raises(llama):
    model = llama
    with pytest.raises(RuntimeError, match="boom"), kvboost_attention(model):
        assert model.config._attn_implementation == "kvboost_attention"
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
