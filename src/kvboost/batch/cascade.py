"""Shared-prefix ("cascade") attention: rows of a batch read one prefix K/V tensor [1, kv_heads, P, d], never B copies:
the prefix part (rows, GQA groups and queries folded into the matmul M dimension) and each row's suffix under its own
mask, merged by one log-sum-exp softmax. Switched on only around the scheduler's batched forwards (engine lock held)."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..compat import has_sliding_layers
from ..errors import KVBoostError
from ..model.attention.cast import in_kv_dtype
from ..model.attention.reference import bottom_right_mask
from ..model.attention.switch import switch_unsupported_reason, switched_attention

CASCADE_ATTENTION = "kvboost_cascade"


class SharedPrefixAttentionError(KVBoostError, RuntimeError):
    """The model's attention cannot run (or did not run) through shared-prefix attention exactly."""


def shared_prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix_key: torch.Tensor,
                            prefix_value: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Attention of query [B, Hq, q, d] over prefix_key/value [1, Hkv, P, d] then key/value [B, Hkv, S, d] under `mask`
    ([B or 1, 1, q, S]: bool = may attend, float = bias; None = bottom-right causal). Returns [B, Hq, q, dv]; scores in
    the input dtype, softmax in float32, as eager does."""
    b, hq, q, d = query.shape
    hkv, p = prefix_key.shape[1], prefix_key.shape[2]
    s, dv = key.shape[2], value.shape[-1]
    if prefix_key.shape[0] != 1 or hq % hkv or key.shape[1] != hkv or prefix_value.shape[2] != p:
        raise SharedPrefixAttentionError(
            f"shape mismatch: query {tuple(query.shape)}, key {tuple(key.shape)}, prefix {tuple(prefix_key.shape)}")
    g = hq // hkv
    grouped = query.reshape(b, hkv, g, q, d)
    # Prefix part: every (row, group, query position) of a kv head folded into one M axis, so the prefix is read once.
    q_folded = grouped.permute(1, 0, 2, 3, 4).reshape(hkv, b * g * q, d)
    out_pre, lse_pre = _attend_prefix(q_folded, prefix_key[0], prefix_value[0], scaling)  # [Hkv, M, dv], [Hkv, M]
    out_pre = out_pre.reshape(hkv, b, g, q, dv).permute(1, 0, 2, 3, 4)
    lse_pre = lse_pre.reshape(hkv, b, g, q).permute(1, 0, 2, 3)  # [B, Hkv, g, q]
    own = _attend_own_flash(grouped, key, value, mask, scaling) if b == 1 else None
    if own is not None:  # one row: its own part through the flash kernel too, merged by log-sum-exp
        out_suf, lse_suf = own
        # The prefix's share of the joint softmax, exp(lse_pre) / (exp(lse_pre) + exp(lse_suf)), in one stable op.
        w_pre = torch.sigmoid(lse_pre - lse_suf)[..., None]
        out = torch.lerp(out_suf.float(), out_pre.float(), w_pre)
        return out.to(value.dtype).reshape(b, hq, q, dv)
    # Suffix part: each row over its own keys.
    s_suf = torch.matmul(grouped.reshape(b, hkv, g * q, d), key.transpose(-1, -2)).float().mul_(scaling)
    s_suf = s_suf.view(b, hkv, g, q, s)
    if mask is None:
        if q > 1:
            causal = bottom_right_mask(q, s, device=query.device)[0, 0]
            s_suf.masked_fill_(~causal, float("-inf"))
    elif mask.dtype == torch.bool:
        s_suf.masked_fill_(~mask[:, :, None], float("-inf"))
    else:
        s_suf.add_(mask[:, :, None].float())
    # Joint softmax (log-sum-exp merge): the prefix part is finite (P >= 1), so no row is fully masked.
    top = torch.maximum(lse_pre, s_suf.amax(-1))
    e_suf = (s_suf - top[..., None]).exp_()
    w_pre = (lse_pre - top).exp_()  # the prefix keys' share of the denominator, over exp(top)
    inv = (w_pre + e_suf.sum(-1)).reciprocal_()
    out_suf = torch.matmul(e_suf.mul_(inv[..., None]).to(value.dtype).view(b, hkv, g * q, s), value)
    out = out_pre.float().mul_((w_pre * inv)[..., None]).add_(out_suf.view(b, hkv, g, q, dv).float())
    return out.to(value.dtype).reshape(b, hq, q, dv)


def _attend_prefix(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of query [H, M, d] over key/value [H, P, d]: (normalized output [H, M, dv], float32
    log-sum-exp of the scaled scores [H, M])."""
    if query.device.type == "cpu" and query.dtype in _FLASH_DTYPES:
        # torch's CPU flash kernel streams the keys in tiles, never materializing [H, M, P] scores.
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query[None], key[None], value[None], 0.0, False, scale=scaling)
        return out[0], lse[0]
    scores = torch.matmul(query, key.transpose(-1, -2)).float().mul_(scaling)
    lse = torch.logsumexp(scores, -1)
    return torch.matmul(scores.sub_(lse[..., None]).exp_().to(value.dtype), value), lse


def _attend_own_flash(grouped: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      scaling: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One row's queries grouped [1, Hkv, g, q, d] over its own key/value [1, Hkv, S, d] under `mask` (bool or None =
    bottom-right causal) through torch's CPU flash kernel, the group folded into the query axis: (normalized output
    [1, Hkv, g, q, dv], float32 log-sum-exp [1, Hkv, g, q]). None where the kernel cannot run it exactly (another
    device or dtype, a float mask, a query that sees no key of its own)."""
    _, hkv, g, q, d = grouped.shape
    s = key.shape[2]
    if grouped.device.type != "cpu" or grouped.dtype not in _FLASH_DTYPES or s < q:
        return None
    bias = _own_bias(mask, q, s, g, grouped.dtype)
    if bias is None:
        return None
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        grouped.reshape(1, hkv, g * q, d), key, value, 0.0, False, attn_mask=bias, scale=scaling)
    return out.reshape(1, hkv, g, q, -1), lse.reshape(1, hkv, g, q)


def _own_bias(mask: torch.Tensor | None, q: int, s: int, g: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The own part's float bias [g * q, s] for `mask` (bool or None = bottom-right causal), or None where some query
    would see no key. Kept for the rest of a cascade block: every layer of a forward passes the same mask."""
    ctx: _Context | None = getattr(_local, "ctx", None)
    key = (q, s, g, dtype)
    if ctx is not None and ctx.bias is not None and ctx.bias[0] is mask and ctx.bias[1] == key:
        return ctx.bias[2]
    if mask is None:
        allowed = bottom_right_mask(q, s)[0, 0]
    elif mask.dtype == torch.bool and mask.shape[0] == 1 and bool(mask.any(-1).all()):
        allowed = mask[0, 0]
    else:
        return None
    bias = torch.zeros(g * q, s, dtype=dtype).masked_fill_(~allowed.repeat(g, 1), float("-inf"))
    if ctx is not None:  # holding the mask keeps its identity from being reused by another tensor
        ctx.bias = (mask, key, bias)
    return bias


_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- transformers wiring --------------------------------------------------------------------------------
class _Context:
    def __init__(self, cache) -> None:
        self.cache = cache
        self.calls = 0
        self.bias: tuple | None = None  # (mask, (q, s, g, dtype), bias): _own_bias's last


_local = threading.local()


def _cascade_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, dropout: float = 0.0,
                               scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    ctx: _Context | None = getattr(_local, "ctx", None)
    if ctx is None:  # another caller of the model while a runner had it switched: plain sdpa, same mask format
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        raise SharedPrefixAttentionError(f"{type(module).__name__} has no layer_idx; cannot find its shared prefix")
    for name in ("softcap", "sliding_window", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise SharedPrefixAttentionError(f"attention with {name} is not supported by shared-prefix attention")
    if module.training and dropout:
        raise SharedPrefixAttentionError("shared-prefix attention is inference-only (dropout > 0 in training)")
    prefix = getattr(ctx.cache.layers[layer_idx], "shared_prefix", None)
    if prefix is None:
        raise SharedPrefixAttentionError(f"cache layer {layer_idx} exposes no shared_prefix")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = shared_prefix_attention(query, key, value, prefix[0], prefix[1], attention_mask, scale)
    ctx.calls += 1
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(CASCADE_ATTENTION, in_kv_dtype(_cascade_attention_forward))
# Masks are built exactly as for sdpa, so the sdpa fallback gets the format it expects.
AttentionMaskInterface.register(CASCADE_ATTENTION, sdpa_mask)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why shared-prefix attention cannot be exact for this model (None: it can)."""
    reason = switch_unsupported_reason(model)
    if reason is not None:
        return reason
    text = model.config.get_text_config()
    if getattr(text, "attn_logit_softcapping", None):
        return "attention logit softcapping"
    if has_sliding_layers(model):
        return "sliding-window attention layers"
    if getattr(text, "is_causal", True) is False:
        return "non-causal attention"
    return None


@contextmanager
def cascade_forward(model: torch.nn.Module, cache) -> Iterator[None]:
    """Run the model's forwards in this block through shared-prefix attention over `cache`'s layers (engine lock held);
    a forward in which some layer bypassed the shared prefix raises instead of returning wrong output."""
    ctx = _Context(cache)
    previous = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        with switched_attention(model, CASCADE_ATTENTION):
            yield
    finally:
        _local.ctx = previous
    expected = len(cache.layers)
    if ctx.calls != expected:
        raise SharedPrefixAttentionError(
            f"{type(model).__name__}: {ctx.calls} of {expected} attention layers ran through shared-prefix "
            "attention; the output would be wrong (disable shared_prefix_attention for this model)")
