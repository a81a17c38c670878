"""The attention kernel micro-benchmark (`kvboost bench gpu`'s section d) on CPU: only the SDPA variants run."""
from __future__ import annotations

import torch

from benchmarks.gpu.attention_kernels import Shape, kernel_timings


def test_kernel_timings_on_cpu_times_the_fallbacks_only():
    rows = kernel_timings("cpu", torch.float32, [Shape(q_heads=4, kv_heads=2, q_len=8, kv_len=40, head_dim=32)],
                          repeats=2)
    assert {r["impl"] for r in rows} == {"sdpa_lower_right", "sdpa_fallback", "sdpa_math"}  # interpreter untimed
    for r in rows:
        assert "error" not in r, r
        assert r["median_ms"] > 0 and r["first_call_ms"] > 0 and r["max_abs_diff"] < 1e-4
