"""Which attention implementation runs, and one entry point that runs it.

`attention()` computes, for query [B, Hq, q, d] over key/value [B, Hkv, kv, d]: per batch row b with valid
length end_b, query i (at position end_b - q + i) sees key j iff j <= end_b - q + i (bottom-right causal, as
prefill over a cache needs) and key_valid[b, j]. end_b = lengths[b] if given, else past + q, else kv.
Keys past end_b are never read, so callers may hand the whole workspace buffer.

"triton" (prefill.py / decode.py) runs on CUDA when triton is installed; "sdpa" (reference.py) everywhere
else: torch SDPA with the cuDNN backend excluded. Neither builds anything per (q_len, kv_len).
"""
from __future__ import annotations

import functools
from typing import Literal

import torch

from .reference import sdpa_attention
from .support import (
    KERNEL_DTYPES,
    MAX_HEAD_DIM,
    KernelUnsupportedError,
    interpreted,
    kernel_refusal,
    triton_available,
)

Backend = Literal["triton", "sdpa"]
# Decode kernel while the GQA group times the query count fits one M tile: it folds the group into M and
# splits the keys, so short query blocks over long caches still fill the GPU. Above that, prefill tiles.
DECODE_MAX_ROWS = 64


@functools.lru_cache(maxsize=64)
def _select(device_type: str, dtype: torch.dtype, head_dim: int, head_dim_v: int,
            prefer: str | None, interp: bool) -> tuple[Backend, str]:
    if prefer not in (None, "triton", "sdpa"):
        raise ValueError(f"backend must be 'triton', 'sdpa' or None, not {prefer!r}")
    if prefer == "sdpa":
        return "sdpa", "sdpa requested"
    why_not = None
    if not triton_available():
        why_not = "triton is not installed (pip install 'kvboost[gpu]')"
    elif device_type != "cuda" and not (prefer == "triton" and interp):
        why_not = f"the triton kernels run on CUDA; this is {device_type} (TRITON_INTERPRET=1 runs them on CPU)"
    elif dtype not in KERNEL_DTYPES:
        why_not = f"dtype {dtype} (kernels take fp16, bf16, fp32)"
    elif head_dim_v != head_dim:
        why_not = f"key head dim {head_dim} != value head dim {head_dim_v}"
    elif not 0 < head_dim <= MAX_HEAD_DIM:
        why_not = f"head dim {head_dim} (kernels take 1..{MAX_HEAD_DIM})"
    if why_not is None:
        return "triton", ("triton requested; " if prefer else "") + \
            ("interpreted on CPU" if device_type != "cuda" else "CUDA with triton")
    if prefer == "triton":
        return "sdpa", f"triton requested but unavailable: {why_not}"
    return "sdpa", why_not


def select_backend(device: torch.device | str, dtype: torch.dtype, head_dim: int, *,
                   head_dim_v: int | None = None, prefer: str | None = None) -> tuple[Backend, str]:
    """("triton" | "sdpa", why). prefer="triton" lets the CPU run the kernels under TRITON_INTERPRET=1 (tests);
    prefer="sdpa" forces the fallback. Cached per argument tuple: cheap enough to call on every forward."""
    device_type = torch.device(device).type
    return _select(device_type, dtype, int(head_dim), int(head_dim if head_dim_v is None else head_dim_v),
                   prefer, interpreted())


def run_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float, kv_len: int,
               ends: torch.Tensor | None, key_valid: torch.Tensor | None) -> torch.Tensor:
    """The Triton kernel for these shapes: split-K decode for few (GQA-folded) queries, tiled prefill otherwise."""
    group = query.shape[1] // key.shape[1]
    if group * query.shape[2] <= DECODE_MAX_ROWS:
        from .decode import decode_attention

        return decode_attention(query, key, value, scale=scale, kv_len=kv_len, ends=ends, key_valid=key_valid)
    from .prefill import prefill_attention

    return prefill_attention(query, key, value, scale=scale, kv_len=kv_len, ends=ends, key_valid=key_valid)


def dispatch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, past: int | None = None,
             lengths: torch.Tensor | None = None, key_valid: torch.Tensor | None = None,
             scale: float | None = None, backend: str | None = None) -> tuple[torch.Tensor, Backend, str]:
    """`attention()`, also saying which backend ran and why: (out [B, Hq, q, d], backend, reason)."""
    q_len, kv_cap, d = query.shape[2], key.shape[2], query.shape[-1]
    kv_len = kv_cap if past is None else int(past) + q_len
    if kv_len > kv_cap:
        raise ValueError(f"past {past} + {q_len} queries > the {kv_cap} keys given")
    scale = d ** -0.5 if scale is None else float(scale)
    choice, why = select_backend(query.device, query.dtype, d, head_dim_v=value.shape[-1], prefer=backend)
    if choice == "triton":
        refusal = kernel_refusal(query, key, value)
        if refusal is None:
            out = run_kernel(query, key, value, scale=scale, kv_len=kv_len, ends=lengths, key_valid=key_valid)
            return out, "triton", why
        why = refusal
    if backend == "triton":
        raise KernelUnsupportedError(f"triton requested: {why}")
    out = sdpa_attention(query, key, value, scale=scale, kv_len=kv_len, ends=lengths, key_valid=key_valid)
    return out, "sdpa", why


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, past: int | None = None,
              lengths: torch.Tensor | None = None, key_valid: torch.Tensor | None = None,
              scale: float | None = None, backend: str | None = None) -> torch.Tensor:
    """Bottom-right causal attention of query [B, Hq, q, d] over key/value [B, Hkv, kv, d] -> [B, Hq, q, d].

    past: tokens cached before the queries (valid length past + q <= kv; default kv - q);
    lengths [B]: per-row valid lengths (ragged batches; clamped to past + q); key_valid [B, >= kv]: per-key
    padding, True = may attend; scale: default d ** -0.5; backend: None (auto), "triton" (raises
    KernelUnsupportedError where it cannot run) or "sdpa". A query that sees no key returns zeros; the output
    is in the input dtype.
    """
    return dispatch(query, key, value, past=past, lengths=lengths, key_valid=key_valid, scale=scale,
                    backend=backend)[0]
