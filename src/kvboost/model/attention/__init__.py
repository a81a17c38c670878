"""KVBoost's attention backend: Triton kernels for prefill over a cache and split-K decode, an SDPA fallback
without cuDNN's per-shape plans, and the transformers wiring that runs KVBoost's own forwards through them.

Importing this package never imports triton (the kernels load on first use on CUDA).
"""
from .backend import DECODE_MAX_ROWS, attention, dispatch, select_backend
from .hf import KVBOOST_ATTENTION, AttentionContext, kvboost_attention, unsupported_reason
from .reference import FALLBACK_BACKENDS, bottom_right_mask, reference_attention, sdpa_attention
from .support import KernelUnsupportedError, interpreted, triton_available

__all__ = [
    "DECODE_MAX_ROWS", "FALLBACK_BACKENDS", "KVBOOST_ATTENTION", "AttentionContext", "KernelUnsupportedError",
    "attention", "bottom_right_mask", "dispatch", "interpreted", "kvboost_attention", "reference_attention",
    "sdpa_attention", "select_backend", "triton_available", "unsupported_reason",
]
