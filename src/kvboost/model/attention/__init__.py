"""KVBoost's attention backend: Triton prefill and split-K decode kernels, an SDPA fallback, and the transformers
wiring. Importing this package never imports triton."""
from .backend import DECODE_MAX_ROWS, attention, dispatch, select_backend
from .hf import KVBOOST_ATTENTION, AttentionContext, kvboost_attention, unsupported_reason
from .reference import FALLBACK_BACKENDS, bottom_right_mask, reference_attention, sdpa_attention
from .support import KernelUnsupportedError, interpreted, triton_available

__all__ = [
    "DECODE_MAX_ROWS", "FALLBACK_BACKENDS", "KVBOOST_ATTENTION", "AttentionContext", "KernelUnsupportedError",
    "attention", "bottom_right_mask", "dispatch", "interpreted", "kvboost_attention", "reference_attention",
    "sdpa_attention", "select_backend", "triton_available", "unsupported_reason",
]
