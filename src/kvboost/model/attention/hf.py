"""transformers wiring: KVBoost's attention as an `AttentionInterface` implementation, for its forwards only. What
the kernels cannot do exactly falls back, counted: softcap / sinks -> the model's eager attention; sliding window,
non-causal, dropout, bias, a foreign mask -> torch SDPA without cuDNN."""
from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, prepare_padding_mask, sdpa_mask

from .backend import dispatch
from .cast import in_kv_dtype
from .reference import bottom_right_mask, sdpa_with_mask
from .switch import switch_unsupported_reason as unsupported_reason  # noqa: F401 - the package's public name
from .switch import switched_attention

KVBOOST_ATTENTION = "kvboost_attention"
_EAGER_ONLY = ("softcap", "s_aux", "sinks")  # scores must be transformed before softmax: SDPA cannot
_SDPA_ONLY = ("sliding_window", "position_bias")  # exact with the (materialized) mask


@dataclass
class AttentionContext:
    """What one `kvboost_attention` block did: calls per path (for tests, logs and bench)."""

    backend: str | None = None  # None: auto; "triton" / "sdpa": forced
    # [B] valid key lengths on the device: a static cache hands the whole buffer; a graph reads only device memory.
    lengths: torch.Tensor | None = None
    counts: Counter = field(default_factory=Counter)

    @property
    def calls(self) -> int:
        return sum(self.counts.values())


@dataclass
class _MaskRecord:
    mask: torch.Tensor  # strong ref: `is` identity stays meaningful while the record lives
    key_valid: torch.Tensor  # [B, kv] bool, True = may attend


_local = threading.local()  # .ctx: AttentionContext | None; .record: _MaskRecord | None


def kvboost_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None,
                 **kwargs) -> torch.Tensor | None:
    """AttentionMaskInterface entry: sdpa's bool [B, 1, q, kv] mask, or None for bottom-right causal."""
    args = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask)
    kwargs.pop("allow_is_causal_skip", None)
    plain = (mask_function is causal_mask_function and type(q_offset) is int and type(kv_offset) is int
             and q_offset + q_length == kv_offset + kv_length)
    if not plain:  # no skip: a None here would mean top-left causal (static-cache prefill), not bottom-right
        return sdpa_mask(**args, allow_is_causal_skip=False, **kwargs)
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is None:
        return None
    mask = sdpa_mask(**args, allow_is_causal_skip=False, **kwargs)
    if getattr(_local, "ctx", None) is not None:  # recorded only inside a block: bounded lifetime
        _local.record = _MaskRecord(mask, padding[:, kv_offset:kv_offset + kv_length])
    return mask


def _fallback_reason(module: torch.nn.Module, dropout: float, is_causal: bool | None, kwargs: dict) -> str | None:
    for name in _EAGER_ONLY + _SDPA_ONLY:
        if kwargs.get(name) is not None:
            return name
    if (is_causal if is_causal is not None else getattr(module, "is_causal", True)) is False:
        return "non_causal"
    if module.training and dropout:
        return "dropout"
    if kwargs.get("output_attentions"):
        return "output_attentions"
    return None


def _eager(module, query, key, value, mask, dropout, scaling, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's own eager attention (it knows softcap/sinks), with the additive float mask it expects."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(f"{type(module).__name__}: attention needs softcap/sinks and its module defines "
                                  "no eager_attention_forward to run them")
    if mask is None and query.shape[2] > 1:  # None is bottom-right causal here; eager needs it spelled out
        mask = bottom_right_mask(query.shape[2], key.shape[2], device=query.device)
    if mask is not None and mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=query.dtype, device=query.device)
        mask = torch.where(mask, zero, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def kvboost_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, is_causal: bool | None = None,
                              **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """AttentionInterface entry: query [B, Hq, q, d], key/value [B, Hkv, kv, d] -> ([B, q, Hq, d], None)."""
    ctx: AttentionContext | None = getattr(_local, "ctx", None)
    counts = ctx.counts if ctx is not None else Counter()  # another thread mid-block: exact, just not counted
    backend = ctx.backend if ctx is not None else None
    lengths = ctx.lengths if ctx is not None else None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    reason = _fallback_reason(module, dropout, is_causal, kwargs)
    key_valid = None
    if reason is None and attention_mask is not None:
        record: _MaskRecord | None = getattr(_local, "record", None)
        if record is not None and record.mask is attention_mask and record.key_valid.shape[-1] == key.shape[2]:
            key_valid = record.key_valid
        else:
            reason = "mask"  # a mask this module did not build: its pattern is unknown, SDPA applies it as is
    if reason is not None and lengths is not None:
        # Keys past each row's end are stale workspace columns: only the kernels' own path honours `lengths`.
        raise NotImplementedError(f"attention over a static cache needs the plain causal path, not {reason}")
    if reason in _EAGER_ONLY:
        counts[f"eager:{reason}"] += 1
        return _eager(module, query, key, value, attention_mask, dropout, scale, **kwargs)
    if reason is not None:
        counts[f"sdpa:{reason}"] += 1
        causal = reason != "non_causal"  # non-causal: a None mask means every key
        mask = attention_mask
        if causal and mask is None and 1 < query.shape[2] != key.shape[2]:  # SDPA reads None as top-left causal
            mask = bottom_right_mask(query.shape[2], key.shape[2], device=query.device)
        bias = kwargs.get("position_bias")
        if bias is not None:  # additive; a bool mask becomes -inf where it forbids
            if mask is None:
                mask = bias
            else:
                mask = bias.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else bias + mask
        causal = causal and mask is None and query.shape[2] > 1  # left: q == kv, where top-left == bottom-right
        out = sdpa_with_mask(query, key, value, mask, scale=scale, is_causal=causal,
                             dropout=dropout if module.training else 0.0)
    else:
        out, used, _ = dispatch(query, key, value, lengths=lengths, key_valid=key_valid, scale=scale, backend=backend)
        counts[used] += 1  # "triton", or "sdpa" (the fallback computing the same bottom-right semantics)
    return out.transpose(1, 2), None


AttentionInterface.register(KVBOOST_ATTENTION, in_kv_dtype(kvboost_attention_forward))
AttentionMaskInterface.register(KVBOOST_ATTENTION, kvboost_mask)


@contextmanager
def kvboost_attention(model: torch.nn.Module, *, backend: str | None = None,
                      lengths: torch.Tensor | None = None) -> Iterator[AttentionContext]:
    """Run the model's forwards in this block through KVBoost's attention (hold the engine lock)."""
    ctx = AttentionContext(backend, lengths)
    previous = getattr(_local, "ctx", None), getattr(_local, "record", None)
    _local.ctx, _local.record = ctx, None
    try:
        with switched_attention(model, KVBOOST_ATTENTION):
            yield ctx
    finally:
        _local.ctx, _local.record = previous
