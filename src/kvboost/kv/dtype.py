"""The dtype the engine keeps K/V in (EngineConfig.kv_dtype): the workspace, stored chunks and every tier.

K/V may be narrower than the model computes in (llama.cpp keeps f16 K/V beside f32 activations): keys and values are
rounded when written, and attention runs its query in the K/V's dtype (model/attention/cast.py). Attention over the
cache is memory-bound, so half the bytes is about half its time, and twice the tokens fit every tier.
"""
from __future__ import annotations

import torch

KV_DTYPES = ("auto", "model", "bfloat16", "float16", "float32")


def native_bf16_cpu() -> bool:
    """Whether this CPU computes bfloat16 in hardware (AVX512-BF16 or AMX): elsewhere it is emulated and slower."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def resolve_kv_dtype(choice: str, model_dtype: torch.dtype, device: torch.device, attention: str,
                     quantized: str | None) -> tuple[torch.dtype, str]:
    """(dtype, why) for kv_dtype=choice. "auto": bfloat16 for INT4 weights on a CPU that computes it natively and
    attends with KVBoost's attention (their output already differs from float weights; the long-context step is
    mostly attention), else the model's dtype, so float models give exactly plain transformers' output."""
    if choice == "model":
        return model_dtype, "the model's dtype (kv_dtype='model')"
    if choice != "auto":
        dtype = getattr(torch, choice)
        return dtype, f"kv_dtype={choice!r}" + ("" if dtype == model_dtype else ", narrower than the model's")
    if model_dtype != torch.float32 or device.type != "cpu" or not quantized:
        return model_dtype, "the model's dtype (auto)"
    if attention == "model":
        return model_dtype, "the model's dtype (auto: the model's own attention needs it)"
    if not native_bf16_cpu():
        return model_dtype, "the model's dtype (auto: this CPU has no bfloat16 instructions)"
    return torch.bfloat16, f"bfloat16 (auto: {quantized} weights on a CPU with bfloat16 instructions)"
