"""Which attention implementation runs ("triton" on CUDA with triton, else "sdpa"), and one entry point that runs it."""
from __future__ import annotations

import functools
from typing import Literal

import torch

from .reference import sdpa_attention
from .support import KERNEL_DTYPES, MAX_HEAD_DIM, KernelUnsupportedError, interpreted, kernel_refusal, triton_available

Backend = Literal["triton", "sdpa"]
# Folded rows (GQA group x queries) up to which the split-K kernel always runs: one row tile, decode and drafts.
DECODE_MAX_ROWS = 128
# use_split_kernel's cost model (fitted on an H100): the split path's fixed cost in key tiles, the margin to win.
SPLIT_OVERHEAD_KEYS = 512
SPLIT_MARGIN = 0.9


@functools.lru_cache(maxsize=64)
def _select(device_type: str, dtype: torch.dtype, head_dim: int, head_dim_v: int,
            prefer: str | None, interp: bool) -> tuple[Backend, str]:
    if prefer not in (None, "triton", "sdpa"):
        raise ValueError(f"backend must be 'triton', 'sdpa' or None, not {prefer!r}")
    if prefer == "sdpa":
        return "sdpa", "sdpa requested"
    why_not = None
    if not triton_available():
        from ...install_source import pip_install_extra

        why_not = f"triton is not installed ({pip_install_extra('gpu')})"
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
    """("triton" | "sdpa", why); prefer="triton" runs the kernels interpreted on CPU (tests). Cached."""
    device_type = torch.device(device).type
    return _select(device_type, dtype, int(head_dim), int(head_dim if head_dim_v is None else head_dim_v),
                   prefer, interpreted())


def use_split_kernel(q_len: int, kv_len: int, batch: int, q_heads: int, kv_heads: int, head_dim: int,
                     dtype: torch.dtype, sms: int) -> bool:
    """Whether the split-K kernel runs rather than the prefill kernel (shapes only): always up to DECODE_MAX_ROWS folded
    rows, above when the keys its slowest program walks win by SPLIT_MARGIN."""
    from .decode import split_plan
    from .prefill import default_blocks

    if q_heads // kv_heads * q_len <= DECODE_MAX_ROWS:
        return True
    plan = split_plan(q_len, kv_len, batch, q_heads, kv_heads, head_dim, dtype, sms)
    if plan.n_splits < 2:
        return False
    prefill_programs = -(-q_len // default_blocks(head_dim, dtype)[0]) * batch * q_heads
    prefill_keys = -(-prefill_programs // sms) * kv_len
    split_programs = plan.row_tiles * plan.n_splits * batch * kv_heads
    split_keys = -(-split_programs // sms) * plan.split_len + SPLIT_OVERHEAD_KEYS
    return split_keys < SPLIT_MARGIN * prefill_keys


def run_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float, kv_len: int,
               ends: torch.Tensor | None, key_valid: torch.Tensor | None) -> torch.Tensor:
    """The Triton kernel for these shapes (use_split_kernel): split-K over the keys, or tiled prefill."""
    from .decode import decode_attention, sm_count

    b, hq, q_len, d = query.shape
    if use_split_kernel(q_len, kv_len, b, hq, key.shape[1], d, query.dtype, sm_count(query.device)):
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
    past: default kv - q; lengths [B]: per-row valid lengths; key_valid [B, >= kv]: True = attend; backend: None
    (auto), "triton" (raises KernelUnsupportedError where it cannot run) or "sdpa". A query that sees no key gets 0."""
    return dispatch(query, key, value, past=past, lengths=lengths, key_valid=key_valid, scale=scale, backend=backend)[0]
