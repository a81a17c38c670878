"""Kernel micro-benchmark: Triton vs torch SDPA variants on prefill-over-cache and decode shapes.

Used by `kvboost bench gpu`. Per shape and implementation it reports the first call on that shape (after the
implementation was warmed on another shape, so one-time compiles are excluded and per-shape plans are not)
and the median of repeated calls. Implementations:

  triton            backend.run_kernel (CUDA with triton only; the CPU interpreter is never timed)
  sdpa_lower_right  torch SDPA with `causal_lower_right` and no mask tensor, flash backend only on CUDA
  sdpa_fallback     reference.sdpa_attention: what KVBoost runs without triton (explicit mask, cuDNN excluded)
  sdpa_math         torch SDPA, math backend, explicit bool mask
"""
from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from kvboost.model.attention.backend import run_kernel, select_backend
from kvboost.model.attention.reference import bottom_right_mask, sdpa_attention


@dataclass(frozen=True)
class Shape:
    """One attention call: `q_len` new queries over `kv_len` keys (the cache plus themselves)."""

    batch: int = 1
    q_heads: int = 16
    kv_heads: int = 2
    q_len: int = 40
    kv_len: int = 1540
    head_dim: int = 128

    @property
    def name(self) -> str:
        return f"b{self.batch}_h{self.q_heads}/{self.kv_heads}_q{self.q_len}_kv{self.kv_len}_d{self.head_dim}"


# The chat-turn shape (Qwen2.5-3B: 16 / 2 heads, d 128), its decode step, and a long-prefix suffix.
DEFAULT_SHAPES = (Shape(), Shape(q_len=1, kv_len=1541), Shape(batch=16, q_len=1, kv_len=1024),
                  Shape(q_len=32, kv_len=30_032))


def _tensors(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    b, hq, hkv, q, kv, d = (shape.batch, shape.q_heads, shape.kv_heads, shape.q_len, shape.kv_len, shape.head_dim)
    query = torch.randn(b, hq, q, d, generator=g).to(device=device, dtype=dtype)
    key = torch.randn(b, hkv, kv, d, generator=g).to(device=device, dtype=dtype)
    value = torch.randn(b, hkv, kv, d, generator=g).to(device=device, dtype=dtype)
    return query, key, value


def _impls(device: torch.device, dtype: torch.dtype, head_dim: int) -> dict[str, Callable]:
    """name -> fn(query, key, value, scale) for every implementation that runs here."""
    impls: dict[str, Callable] = {}
    if device.type == "cuda" and select_backend(device, dtype, head_dim)[0] == "triton":
        impls["triton"] = lambda q, k, v, s: run_kernel(q, k, v, scale=s, kv_len=k.shape[2], ends=None,
                                                        key_valid=None)

    def lower_right(q, k, v, s):
        if k.shape[1] != q.shape[1]:  # CausalBias' flash path calls the op directly, without enable_gqa
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        bias = causal_lower_right(q.shape[2], k.shape[2])
        backends = [SDPBackend.FLASH_ATTENTION] if device.type == "cuda" else \
            [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=s)

    def math(q, k, v, s):
        mask = bottom_right_mask(q.shape[2], k.shape[2], device=q.device)
        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=s, enable_gqa=True)

    impls["sdpa_lower_right"] = lower_right
    impls["sdpa_fallback"] = lambda q, k, v, s: sdpa_attention(q, k, v, scale=s)
    impls["sdpa_math"] = math
    return impls


def _timed(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, torch.Tensor]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3, out


def kernel_timings(device: torch.device | str, dtype: torch.dtype, shapes: Iterable[Shape] = DEFAULT_SHAPES, *,
                   repeats: int = 20, warm_shape: Shape | None = None) -> list[dict]:
    """One row per (shape, implementation): first_call_ms, median_ms, max_abs_diff against sdpa_fallback.

    An implementation that raises on a shape gets a row with its error instead of times.
    """
    device = torch.device(device)
    shapes = list(shapes)
    rows: list[dict] = []
    warm = warm_shape or Shape(batch=1, q_heads=shapes[0].q_heads if shapes else 2,
                               kv_heads=shapes[0].kv_heads if shapes else 1, q_len=7, kv_len=77,
                               head_dim=shapes[0].head_dim if shapes else 64)
    with torch.inference_mode():
        by_dim: dict[int, dict[str, Callable]] = {}
        for shape in shapes:
            impls = by_dim.get(shape.head_dim)
            if impls is None:  # warm every implementation once per head dim: compiles are not per-shape costs
                impls = by_dim[shape.head_dim] = _impls(device, dtype, shape.head_dim)
                wq, wk, wv = _tensors(Shape(**{**asdict(warm), "head_dim": shape.head_dim}), device, dtype)
                for fn in impls.values():
                    try:
                        fn(wq, wk, wv, shape.head_dim ** -0.5)
                    except Exception:  # noqa: BLE001 - reported per shape below
                        pass
            q, k, v = _tensors(shape, device, dtype)
            scale = shape.head_dim ** -0.5
            expected = sdpa_attention(q, k, v, scale=scale).float()  # the fallback is the yardstick
            for name, fn in impls.items():
                row = {"shape": shape.name, **asdict(shape), "impl": name, "device": str(device),
                       "dtype": str(dtype).replace("torch.", "")}
                call = functools.partial(fn, q, k, v, scale)
                try:
                    first, out = _timed(call, device)
                    times = [_timed(call, device)[0] for _ in range(repeats)]
                except Exception as exc:  # noqa: BLE001 - a backend that cannot run this shape is a result too
                    rows.append({**row, "error": f"{type(exc).__name__}: {exc}"[:300]})
                    continue
                diff = float((out.float() - expected).abs().max())
                rows.append({**row, "first_call_ms": round(first, 4), "median_ms": round(statistics.median(times), 4),
                             "spike": round(first / max(statistics.median(times), 1e-9), 2),
                             "max_abs_diff": diff})
    return rows
