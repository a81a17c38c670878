"""Section d of `kvboost bench gpu`: attention kernel timings against torch SDPA at the model's head shape.

Two parts. The SDPA reference is measured here: one attention call in the chat-turn shape (40 queries over
~1,540 cached keys, bottom-right causal) and the decode shape (1 query over 4,096 keys, batch 1 and 16),
per backend, its first call at a shape never seen before (the per-shape cost a chat pays each turn) and its
steady time. The kernels are KVBoost's attention package's, timed by `attention_kernels.kernel_timings`,
imported lazily: where it is missing or cannot run here, the section says so and why.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .settings import GpuBenchSettings
from .timing import Budget, median, timed


def _heads(model) -> tuple[int, int, int]:
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return heads, kv_heads, head_dim


def _backend(name: str):
    """A context selecting one SDPA backend ('default': torch's own choice)."""
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                        "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name])


def _attention(batch: int, heads: int, head_dim: int, q_len: int, kv_len: int, mask: str, device, dtype):
    """One SDPA call's inputs (K/V repeated to every query head, as transformers' sdpa path does) and the call."""
    from torch.nn.attention.bias import causal_lower_right

    q = torch.randn(batch, heads, q_len, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, heads, kv_len, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    if q_len == 1:
        attn_mask = None  # one query sees every key
    elif mask == "lower_right":
        attn_mask = causal_lower_right(q_len, kv_len)
    else:  # the explicit boolean mask transformers builds for a prefill over a cache
        attn_mask = torch.ones(q_len, kv_len, device=device, dtype=torch.bool).tril(kv_len - q_len)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


def _cases(device: torch.device, quick: bool) -> list[tuple[str, int, int, int, str, str]]:
    """(label, batch, q_len, kv_len, mask, backend)."""
    backends = [("default", "bool"), ("default", "lower_right")]
    if device.type == "cuda":
        backends += [("flash", "lower_right"), ("efficient", "lower_right"), ("cudnn", "bool")]
    cases = [(f"prefill 40 q over 1,540 kv, {b} ({m} mask)", 1, 40, 1540, m, b) for b, m in backends]
    decode_backends = ["default"] + (["flash", "cudnn"] if device.type == "cuda" else [])
    for batch in (1, 16):
        cases += [(f"decode 1 q over 4,096 kv, batch {batch}, {b}", batch, 1, 4096, "none", b)
                  for b in decode_backends]
    return cases[:3] if quick and device.type != "cuda" else cases


def sdpa_reference(model, device: torch.device, dtype: torch.dtype, quick: bool, budget: Budget) -> list[dict]:
    heads, _, head_dim = _heads(model)
    rows = []
    for i, (label, batch, q_len, kv_len, mask, backend) in enumerate(_cases(device, quick)):
        if budget.expired():
            rows.append({"case": label, "status": "skipped", "reason": "time budget spent"})
            continue
        row: dict[str, Any] = {"case": label, "batch": batch, "q_len": q_len, "kv_len": kv_len, "heads": heads,
                               "head_dim": head_dim, "backend": backend}
        try:
            with _backend(backend), torch.inference_mode():
                # A key length no earlier case used: the first call pays whatever a new shape costs.
                first_ms, _ = timed(_attention(batch, heads, head_dim, q_len, kv_len + 1 + i, mask, device, dtype),
                                    device)
                call = _attention(batch, heads, head_dim, q_len, kv_len, mask, device, dtype)
                call()
                steady = [timed(call, device)[0] for _ in range(3 if quick else 10)]
            row.update(status="ok", first_call_ms=first_ms, steady_ms=median(steady))
        except Exception as exc:  # a backend that cannot take this shape/mask here: reported, not fatal
            row.update(status="unavailable", reason=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
                       if str(exc).strip() else type(exc).__name__)
        rows.append(row)
    return rows


def _load_kernel_timings() -> tuple[Callable[..., Any] | None, str]:
    """attention_kernels.kernel_timings, or None and why it cannot be imported here."""
    try:  # lazily: it imports KVBoost's attention package, whose kernels may fail to load on this machine
        from .attention_kernels import kernel_timings
    except Exception as exc:
        return None, f"the attention kernels cannot be imported: {type(exc).__name__}: {exc}"
    return kernel_timings, ""


def _model_shapes(fn: Callable[..., Any], heads: int, kv_heads: int, head_dim: int, quick: bool,
                  device: torch.device) -> list | None:
    """The kernel module's default shapes at this model's heads and head dim (None: keep its defaults).
    A CPU smoke run leaves out the long-cache shapes: the fallback there is the math path, minutes at 30k."""
    defaults = getattr(sys.modules.get(fn.__module__), "DEFAULT_SHAPES", None)
    if not defaults:
        return None
    try:
        shapes = [dataclasses.replace(s, q_heads=heads, kv_heads=kv_heads, head_dim=head_dim) for s in defaults]
    except (TypeError, ValueError):  # not dataclasses with those fields: their own defaults it is
        return None
    if quick and device.type != "cuda":
        shapes = [s for s in shapes if getattr(s, "kv_len", 0) <= 4096]
    return shapes


def with_speedups(rows: list[dict], yardstick: str = "sdpa_lower_right") -> list[dict]:
    """Each row's median against the yardstick implementation's on the same shape (>1: faster than it)."""
    base = {r.get("shape"): r.get("median_ms") for r in rows if r.get("impl") == yardstick}
    for r in rows:
        ref, ms = base.get(r.get("shape")), r.get("median_ms")
        r[f"speedup_vs_{yardstick}"] = ref / ms if ref and ms else None
    return rows


def _call(fn: Callable[..., Any], offered: dict[str, Any]) -> Any:
    """Call fn with the offered keyword arguments its signature takes (all of them if it takes **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**offered)
    return fn(**{k: v for k, v in offered.items() if k in params})


def _as_rows(result: Any) -> list[dict]:
    """kernel_timings' answer as table rows: a list of records, or a mapping of case -> record."""
    def record(x: Any) -> dict:
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return dataclasses.asdict(x)
        if isinstance(x, Mapping):
            return dict(x)
        return dict(vars(x)) if hasattr(x, "__dict__") else {"value": x}

    if isinstance(result, Mapping):
        if all(isinstance(v, Mapping) or dataclasses.is_dataclass(v) for v in result.values()):
            return [{"case": str(k), **record(v)} for k, v in result.items()]
        return [dict(result)]
    return [record(x) for x in (result or [])]


def run_kernels(engine, settings: GpuBenchSettings, budget: Budget) -> dict:
    model, device = engine.model, engine.device
    dtype = next(model.parameters()).dtype
    section: dict[str, Any] = {"status": "running", "sdpa": sdpa_reference(model, device, dtype, settings.quick,
                                                                             budget)}
    fn, reason = _load_kernel_timings()
    if fn is None:
        section["kernel"] = {"status": "unavailable", "reason": reason, "rows": []}
    else:
        heads, kv_heads, head_dim = _heads(model)
        offered: dict[str, Any] = {"device": device, "dtype": dtype, "num_heads": heads, "num_kv_heads": kv_heads,
                                   "head_dim": head_dim, "quick": settings.quick}
        if settings.quick:
            offered["repeats"] = 3
        shapes = _model_shapes(fn, heads, kv_heads, head_dim, settings.quick, device)
        if shapes is not None:
            offered["shapes"] = shapes
        try:
            section["kernel"] = {"status": "ok", "rows": with_speedups(_as_rows(_call(fn, offered)))}
        except Exception as exc:  # e.g. no Triton / no GPU for the kernel on this machine
            section["kernel"] = {"status": "unavailable", "rows": [],
                                 "reason": f"kernel_timings() failed: {type(exc).__name__}: {exc}"[:400]}
    section["status"] = "ok"
    return section
