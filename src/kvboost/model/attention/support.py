"""What the Triton kernels can run: capability checks and shared shape rules (query [B, Hq, q, d], key/value [B,
Hkv, kv, d]). Nothing here imports triton at module level."""
from __future__ import annotations

import functools
import os

import torch

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MIN_BLOCK_DIM = 16  # tl.dot needs every matmul dimension >= 16, so tiny head dims are padded up to it
LOG2E = 1.4426950408889634  # the kernels' softmax runs in base 2: exp(x) = exp2(x * log2(e))


class KernelUnsupportedError(ValueError):
    """The inputs are outside what the Triton kernels compute exactly; the caller must use the SDPA fallback."""


@functools.cache
def triton_available() -> bool:
    """True when triton imports (it may be absent: it is the optional `gpu` extra)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install whose import raises something else
        return False
    return True


def interpreted() -> bool:
    """True when triton kernels run in its CPU interpreter (TRITON_INTERPRET=1, read when a kernel is decorated)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether kernels upcast tiles to fp32 before tl.dot: triton 3.x's interpreter multiplies bf16 tiles wrongly."""
    return dtype == torch.bfloat16 and interpreted()


def padded_head_dim(head_dim: int) -> int:
    """The power of two the kernels tile the head dim to (80 -> 128, 96 -> 128); the pad lanes are masked."""
    return max(MIN_BLOCK_DIM, 1 << (head_dim - 1).bit_length())


def kernel_refusal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why the kernels cannot take these tensors (None: they can). Checked on shapes/dtypes only: no sync."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "query/key/value must be 4-D [B, H, S, d]"
    b, hq, _, d = query.shape
    if key.shape[0] != b or value.shape[0] != b or key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2]:
        return f"batch/head/length mismatch: query {tuple(query.shape)}, key {tuple(key.shape)}, " \
               f"value {tuple(value.shape)}"
    if key.shape[-1] != d or value.shape[-1] != d:
        return f"key/value head dims ({key.shape[-1]}, {value.shape[-1]}) differ from the query's ({d})"
    if d > MAX_HEAD_DIM:
        return f"head dim {d} > {MAX_HEAD_DIM}"
    if hq % key.shape[1]:
        return f"{hq} query heads are not a multiple of {key.shape[1]} kv heads"
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in KERNEL_DTYPES:
        return f"dtypes {query.dtype}/{key.dtype}/{value.dtype} (the kernels take one of fp16, bf16, fp32)"
    if not (query.device == key.device == value.device):
        return "query/key/value on different devices"
    return None


def kernel_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_len: int | None,
                  ends: torch.Tensor | None, key_valid: torch.Tensor | None) -> tuple:
    """The kernels' checked inputs: (query, key, value with d contiguous, kv_len, ends, key_valid), refusals raised as
    KernelUnsupportedError. `ends` stays as is when int32/int64 on the query's device (else int32), `key_valid` becomes
    uint8. Checked on shapes only, never reading a value: safe inside a CUDA-graph capture."""
    reason = kernel_refusal(query, key, value)
    if reason:
        raise KernelUnsupportedError(reason)
    batch, kv_cap, device = query.shape[0], key.shape[2], query.device
    kv_len = kv_cap if kv_len is None else int(kv_len)
    if not 0 <= kv_len <= kv_cap:
        raise KernelUnsupportedError(f"kv_len {kv_len} outside the key tensor's {kv_cap} columns")
    if ends is not None:
        if ends.shape != (batch,):
            raise KernelUnsupportedError(f"ends must be [B] = [{batch}], got {tuple(ends.shape)}")
        if ends.dtype not in (torch.int32, torch.int64) or ends.device != device:
            ends = ends.to(device=device, dtype=torch.int32)
    if key_valid is not None:
        if key_valid.dim() != 2 or key_valid.shape[0] != batch or key_valid.shape[1] < kv_len:
            raise KernelUnsupportedError(f"key_valid must be [B, >= kv] = [{batch}, {kv_len}], "
                                         f"got {tuple(key_valid.shape)}")
        key_valid = key_valid.to(device=device, dtype=torch.bool)
        if key_valid.stride(-1) != 1:
            key_valid = key_valid.contiguous()
        key_valid = key_valid.view(torch.uint8)  # triton loads bytes; bool pointers are awkward across versions
    # The kernels index [b, h, s] by strides but read d as contiguous lanes.
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    return query, key, value, kv_len, ends, key_valid
