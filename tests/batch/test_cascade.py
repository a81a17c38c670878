"""Shared-prefix (cascade) attention equals plain attention over [prefix; row's own K/V]."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache

from kvboost.batch.cascade import (
    CASCADE_ATTENTION,
    SharedPrefixAttentionError,
    cascade_forward,
    shared_prefix_attention,
    unsupported_reason,
)
from kvboost.model.attention.reference import bottom_right_mask
from kvboost.model.cache_arg import cache_kwargs

from ..devices import assert_on
from ..tiny_models import make_tiny_model


def _reference(query, key, value, pk, pv, mask):
    """sdpa over the prefix copied into every row, then each row's own K/V."""
    b, hq, q, _ = query.shape
    g = hq // key.shape[1]
    full_k = torch.cat([pk.expand(b, -1, -1, -1), key], 2).repeat_interleave(g, 1)
    full_v = torch.cat([pv.expand(b, -1, -1, -1), value], 2).repeat_interleave(g, 1)
    full_mask = torch.cat([torch.ones(b, 1, q, pk.shape[2], dtype=torch.bool, device=query.device),
                           mask.expand(b, 1, q, -1)], -1)
    return F.scaled_dot_product_attention(query, full_k, full_v, attn_mask=full_mask)


def _ragged_causal_mask(lengths: list[int], q: int, device: torch.device) -> torch.Tensor:
    """Row b owns suffix columns [0, lengths[b]); its q queries are its last q tokens."""
    mask = torch.zeros(len(lengths), 1, q, max(lengths), dtype=torch.bool)
    for b, n in enumerate(lengths):
        for i in range(q):
            mask[b, 0, i, : n - q + i + 1] = True
    return mask.to(device)


def _randn(*shape: int, device: torch.device) -> torch.Tensor:
    """Seeded CPU draws (the same numbers on every device), moved to the device."""
    return torch.randn(*shape).to(device)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("q", [1, 5])
def test_matches_sdpa_with_ragged_rows(heads, kv_heads, q, device):
    torch.manual_seed(heads * 10 + q)
    lengths, d, p = [5, 9, 7], 16, 23
    b, s = len(lengths), max(lengths)
    query = _randn(b, heads, q, d, device=device)
    key, value = _randn(b, kv_heads, s, d, device=device), _randn(b, kv_heads, s, d, device=device)
    pk, pv = _randn(1, kv_heads, p, d, device=device), _randn(1, kv_heads, p, d, device=device)
    mask = _ragged_causal_mask(lengths, q, device)
    out = shared_prefix_attention(query, key, value, pk, pv, mask, d ** -0.5)
    assert out.shape == (b, heads, q, d)
    assert_on(device, out)
    torch.testing.assert_close(out, _reference(query, key, value, pk, pv, mask), atol=1e-5, rtol=1e-5)
    # An additive float mask (eager format) means the same thing.
    bias = torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))
    torch.testing.assert_close(shared_prefix_attention(query, key, value, pk, pv, bias, d ** -0.5), out,
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("q,s", [(1, 6), (6, 6), (4, 9)])
def test_no_mask_means_causal_from_the_last_query(q, s, device):
    torch.manual_seed(q + s)
    query, key, value = (_randn(2, 4, q, 8, device=device), _randn(2, 2, s, 8, device=device),
                         _randn(2, 2, s, 8, device=device))
    pk, pv = _randn(1, 2, 11, 8, device=device), _randn(1, 2, 11, 8, device=device)
    expected = _reference(query, key, value, pk, pv, _ragged_causal_mask([s, s], q, device))
    torch.testing.assert_close(shared_prefix_attention(query, key, value, pk, pv, None, 8 ** -0.5), expected,
                               atol=1e-5, rtol=1e-5)


def test_scaling_is_applied(device):
    torch.manual_seed(3)
    query, key, value = (_randn(1, 2, 1, 8, device=device), _randn(1, 2, 3, 8, device=device),
                         _randn(1, 2, 3, 8, device=device))
    pk, pv = _randn(1, 2, 4, 8, device=device), _randn(1, 2, 4, 8, device=device)
    mask = torch.ones(1, 1, 1, 3, dtype=torch.bool, device=device)
    expected = F.scaled_dot_product_attention(query, torch.cat([pk, key], 2), torch.cat([pv, value], 2), scale=0.3)
    torch.testing.assert_close(shared_prefix_attention(query, key, value, pk, pv, mask, 0.3), expected,
                               atol=1e-5, rtol=1e-5)


def test_prefix_is_never_expanded_per_row(monkeypatch, device):
    """The prefix part sees the [kv_heads, P, d] tensor itself, once, with every row's queries folded in: one read for
    every row."""
    from kvboost.batch import cascade

    seen = []
    real = cascade._attend_prefix

    def spy(query, key, value, scaling):
        seen.append((query.shape, key))
        return real(query, key, value, scaling)

    monkeypatch.setattr(cascade, "_attend_prefix", spy)
    pk = _randn(1, 2, 7, 8, device=device)
    shared_prefix_attention(_randn(5, 4, 1, 8, device=device), _randn(5, 2, 3, 8, device=device),
                            _randn(5, 2, 3, 8, device=device), pk, _randn(1, 2, 7, 8, device=device),
                            torch.ones(5, 1, 1, 3, dtype=torch.bool, device=device), 0.35)
    assert len(seen) == 1
    folded, key = seen[0]
    assert folded == (2, 5 * 2, 8)  # [kv heads, rows x group x queries, d]
    assert key.shape == (2, 7, 8) and key.data_ptr() == pk.data_ptr()


@pytest.mark.parametrize("rows, mask", [(3, None), (1, None), (1, "bool")])
def test_prefix_part_matches_without_the_flash_kernel(monkeypatch, device, rows, mask):
    """The CPU flash kernel (the prefix part; one row's own part too) and plain math give the same attention."""
    from kvboost.batch import cascade

    if mask == "bool":
        mask = torch.ones(1, 1, 2, 4, dtype=torch.bool, device=device).tril(2)
        mask[0, 0, 0, 0] = False  # not plain causal: the mask given is what applies
    args = (_randn(rows, 4, 2, 8, device=device), _randn(rows, 2, 4, 8, device=device),
            _randn(rows, 2, 4, 8, device=device), _randn(1, 2, 9, 8, device=device), _randn(1, 2, 9, 8, device=device),
            mask, 0.35)
    fast = shared_prefix_attention(*args)
    monkeypatch.setattr(cascade, "_FLASH_DTYPES", ())
    torch.testing.assert_close(shared_prefix_attention(*args), fast, atol=1e-5, rtol=1e-5)


def test_one_rows_mask_bias_is_rebuilt_for_each_new_mask(monkeypatch, device):
    """Inside a cascade block the own part's bias is kept for the mask it was built from: a different mask of the same
    shape (the next forward's) gets its own, and None again means causal."""
    from kvboost.batch import cascade

    monkeypatch.setattr(cascade._local, "ctx", cascade._Context(None), raising=False)
    q, k, v, pk, pv = (_randn(1, 4, 3, 8, device=device), _randn(1, 2, 5, 8, device=device),
                       _randn(1, 2, 5, 8, device=device), _randn(1, 2, 6, 8, device=device),
                       _randn(1, 2, 6, 8, device=device))
    first = torch.ones(1, 1, 3, 5, dtype=torch.bool, device=device).tril(2)
    second = first.clone()
    second[0, 0, 2, 0] = False
    causal = bottom_right_mask(3, 5, device=device)
    for mask, expected in ((first, first), (second, second), (first.clone(), first), (None, causal)):
        torch.testing.assert_close(shared_prefix_attention(q, k, v, pk, pv, mask, 8 ** -0.5),
                                   _reference(q, k, v, pk, pv, expected), atol=1e-5, rtol=1e-5)


def test_shape_errors_are_typed(device):
    with pytest.raises(SharedPrefixAttentionError):
        shared_prefix_attention(*(_randn(*shape, device=device) for shape in (
            (2, 4, 1, 8), (2, 2, 3, 8), (2, 2, 3, 8), (2, 2, 5, 8), (2, 2, 5, 8))), None, 0.35)


def test_registered_function_without_a_runner_context_is_plain_sdpa(device):
    fn = AttentionInterface().get_interface(CASCADE_ATTENTION, None)
    module = torch.nn.Module()
    module.layer_idx, module.is_causal, module.num_key_value_groups = 0, True, 2
    module.eval()
    query, key, value = (_randn(1, 4, 3, 8, device=device), _randn(1, 2, 3, 8, device=device),
                         _randn(1, 2, 3, 8, device=device))
    out, _ = fn(module, query, key, value, None, scaling=0.35)
    assert_on(device, out)
    expected = F.scaled_dot_product_attention(query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1),
                                              is_causal=True, scale=0.35).transpose(1, 2)
    tol = 1e-6 if device.type == "cpu" else 1e-5  # GPU sdpa may pick another kernel for GQA than for repeated K/V
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_unsupported_models_are_named(tokenizer):
    assert unsupported_reason(make_tiny_model("llama", tokenizer)) is None
    assert unsupported_reason(make_tiny_model("qwen2", tokenizer)) is None
    assert unsupported_reason(make_tiny_model("gemma2", tokenizer)) is not None
    assert "sliding" in unsupported_reason(make_tiny_model("gemma3", tokenizer))


def test_cascade_forward_restores_the_model_and_refuses_a_partial_run(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    before = model.config._attn_implementation
    cache = DynamicCache()  # its layers expose no shared_prefix: the attention function must refuse
    with pytest.raises(SharedPrefixAttentionError, match="shared_prefix"), cascade_forward(model, cache), \
            torch.inference_mode():
        model(input_ids=torch.tensor([[5, 6, 7]], device=model.device), **cache_kwargs(cache), use_cache=True)
    assert model.config._attn_implementation == before

    class NoLayers:
        layers = [object()] * (model.config.num_hidden_layers + 1)

    # Fewer attention calls than cache layers (a model that bypassed the switch) is an error, not output.
    with pytest.raises(SharedPrefixAttentionError, match="attention layers"), cascade_forward(model, NoLayers()):
        pass
    assert model.config._attn_implementation == before
