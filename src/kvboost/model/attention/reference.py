"""The torch fallback (SDPA without cuDNN, which plans per new (q_len, kv_len)) and a plain-math reference for
tests, both with the kernels' semantics (prefill.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# Order is irrelevant (set_priority=False): torch keeps its own priority among the allowed ones.
FALLBACK_BACKENDS: list[SDPBackend] = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def bottom_right_mask(q_len: int, kv_len: int, *, ends: torch.Tensor | None = None,
                      key_valid: torch.Tensor | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool mask [B or 1, 1, q, kv_len] (True = may attend) of the kernels' semantics."""
    j = torch.arange(kv_len, device=device)
    i = torch.arange(q_len, device=device)
    if ends is None:
        mask = (j[None, :] <= i[:, None] + (kv_len - q_len))[None, None]  # [1, 1, q, kv]
    else:
        end = ends.to(device=device, dtype=torch.long).clamp(max=kv_len)[:, None, None]  # [B, 1, 1]
        mask = ((j[None, None, :] <= i[None, :, None] + end - q_len) & (j[None, None, :] < end))[:, None]
    if key_valid is not None:
        mask = mask & key_valid[:, None, None, :kv_len].to(device=device, dtype=torch.bool)
    return mask


def sdpa_with_mask(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, *,
                   scale: float | None, is_causal: bool = False, dropout: float = 0.0) -> torch.Tensor:
    """torch SDPA [B, Hq, q, d] x [B, Hkv, kv, d] with GQA, cuDNN excluded. `mask`: bool (True = attend) or additive
    float, broadcastable to [B, Hq, q, kv]; None is torch's top-left causal."""
    b, hq, q_len, d = query.shape
    group = hq // key.shape[1]
    if group > 1 and q_len == 1 and mask is not None and mask.shape[1] == 1 and not is_causal:
        # One query per head: fold the group into the query axis, as transformers' sdpa does (bit for bit on CPU).
        packed = query.reshape(b, hq // group, group, d)
        with sdpa_kernel(FALLBACK_BACKENDS):
            out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout, scale=scale)
        return out.reshape(b, hq, 1, value.shape[-1])
    gqa = {}
    if group > 1:
        # CUDA's efficient kernels take enable_gqa only without a mask; with one, repeated K/V keeps them.
        if mask is None or query.device.type != "cuda":
            gqa = {"enable_gqa": True}
        else:
            key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    with sdpa_kernel(FALLBACK_BACKENDS):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                              is_causal=is_causal, scale=scale, **gqa)


def sdpa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float,
                   kv_len: int | None = None, ends: torch.Tensor | None = None,
                   key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels' semantics through torch SDPA (cuDNN excluded); [B, Hq, q, d] in the input dtype."""
    q_len, kv_cap = query.shape[2], key.shape[2]
    kv_len = kv_cap if kv_len is None else int(kv_len)
    if kv_len != kv_cap:  # a workspace view longer than its valid length: read only the valid columns
        key, value = key[:, :, :kv_len], value[:, :, :kv_len]
    if ends is None and key_valid is None and (q_len == 1 or q_len == kv_len):
        return sdpa_with_mask(query, key, value, None, scale=scale, is_causal=q_len > 1)
    mask = bottom_right_mask(q_len, kv_len, ends=ends, key_valid=key_valid, device=query.device)
    out = sdpa_with_mask(query, key, value, mask, scale=scale)
    if ends is not None or key_valid is not None or q_len > kv_len:  # rows that may see no key at all
        out = out.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return out


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float,
                        kv_len: int | None = None, ends: torch.Tensor | None = None,
                        key_valid: torch.Tensor | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Explicit softmax(QK^T * scale) V in `dtype` (float64 by default): the ground truth for tests."""
    q_len, kv_cap = query.shape[2], key.shape[2]
    kv_len = kv_cap if kv_len is None else int(kv_len)
    group = query.shape[1] // key.shape[1]
    k = key[:, :, :kv_len].to(dtype).repeat_interleave(group, 1)
    v = value[:, :, :kv_len].to(dtype).repeat_interleave(group, 1)
    scores = torch.matmul(query.to(dtype), k.transpose(-1, -2)) * scale
    mask = bottom_right_mask(q_len, kv_len, ends=ends, key_valid=key_valid, device=query.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no visible key: all -inf -> 0
    return torch.matmul(probs, v)
