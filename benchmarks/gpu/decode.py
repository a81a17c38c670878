"""Section c of `kvboost bench gpu`: decode tokens/s at batch 1 and 16, KVBoost against transformers.

Systems, on the same model and the same rows (a ~1,000-token shared prefix + a 16-token question each):
  kvboost           engine.generate (batch 1) / engine.generate_batch
  hf eager          model.generate with its default DynamicCache
  hf static+compile model.generate over a StaticCache with generate's own compilation (its default
                    CompileConfig: the decode forward under torch.compile "reduce-overhead", CUDA graphs); skipped
                    with the reason where compiling is off (CPU, --quick), reported, never raised, when it fails
  hf static         the same static cache, not compiled: only where compiling is off, so the path still runs

Decode rate = rows x (tokens(N) - tokens(1)) / (time(N) - time(1)): two runs of the same rows that differ
only in the number of decode steps, so prefill cost cancels out. An untimed run first gives every system
the same state (KVBoost has the prefix stored; libraries are warm; compiled graphs exist).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..prefix import bench_questions, prefix_text
from .settings import GpuBenchSettings
from .timing import Budget, median, timed

SUFFIX_TOKENS = 16
COMPILE_MIN_S = 90.0  # do not start a torch.compile warm-up with less budget than this left


def decode_rows(tokenizer, prompt_tokens: int, batch: int) -> list[list[int]]:
    """`batch` rows of equal length: one shared prefix and a different 16-token question each (no padding)."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prefix = ids(prefix_text(tokenizer, prompt_tokens))[:prompt_tokens]
    questions = bench_questions()
    rows = []
    for i in range(batch):
        q = questions[i % len(questions)]
        suffix = ids(f"\n\nQuestion {i + 1}: {q} {q} {q}")[:SUFFIX_TOKENS - 3] + ids("\nAnswer:")[-3:]
        rows.append(prefix + suffix)
    return rows


Call = Callable[[int], int]  # decode n tokens for every row; returns tokens generated in all


def _kvboost(engine, rows: list[list[int]]) -> Call:
    def call(n: int) -> int:
        if len(rows) == 1:
            return engine.generate(input_ids=rows[0], max_new_tokens=n).generated_tokens
        return sum(r.generated_tokens for r in engine.generate_batch(input_ids=rows, max_new_tokens=n))
    return call


def _hf(model, rows: list[list[int]], pad_id: int, static_len: int | None = None, compiled: bool = False) -> Call:
    ids = torch.tensor(rows, device=model.device)
    mask = torch.ones_like(ids)
    cache = None
    if static_len is not None:
        from transformers import StaticCache

        from kvboost.model.cache_arg import cache_kwargs

        # One cache of a fixed length for every call: compiled graphs see the same shapes and addresses.
        cache = StaticCache(config=model.config, max_cache_len=static_len)

    def call(n: int) -> int:
        kwargs = {}
        if cache is not None:
            cache.reset()
            kwargs.update(cache_kwargs(cache))
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                             pad_token_id=pad_id, disable_compile=not compiled, **kwargs)
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return call


def measure(call: Call, n: int, device: torch.device, repeats: int) -> dict:
    """Untimed warm-up, then time(1) and time(n), medians of `repeats`; the decode rate from their difference."""
    call(n)
    t1 = [timed(lambda: call(1), device) for _ in range(repeats)]
    tn = [timed(lambda: call(n), device) for _ in range(repeats)]
    ms1, msn = median([t for t, _ in t1]), median([t for t, _ in tn])
    tok1, tokn = t1[-1][1], tn[-1][1]
    steps = tokn - tok1
    rate = steps / ((msn - ms1) / 1e3) if msn > ms1 and steps > 0 else float("nan")
    return {"decode_tok_s": rate, "prefill_ms": ms1, "total_ms": msn, "tokens": tokn, "decode_tokens": steps}


class _CompiledGenerate:
    """generate() compiles its decode forward itself (over a StaticCache, on CUDA); afterwards the compiled
    graphs are dropped, so their memory and guards do not leak into later runs."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        torch._dynamo.reset()


def run_decode(engine, settings: GpuBenchSettings, budget: Budget, on_row: Callable[[dict], None]) -> dict:
    model, tok = engine.model, engine.tokenizer
    device = engine.device
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    n = settings.decode_tokens
    section: dict = {"status": "running", "rows": [], "prompt_tokens": settings.decode_prompt_tokens + SUFFIX_TOKENS,
                     "decode_tokens": n}
    all_rows = decode_rows(tok, settings.decode_prompt_tokens, max(settings.batch_sizes))
    static_len = len(all_rows[0]) + n

    def add(system: str, batch: int, fn: Callable[[], dict] | None, reason: str = "") -> None:
        row = {"system": system, "batch": batch}
        if fn is None:
            row.update(status="skipped", reason=reason)
        elif budget.expired():
            row.update(status="skipped", reason=f"time budget ({budget.seconds:.0f} s) spent")
            section["status"] = "truncated"
        else:
            try:
                row.update(fn(), status="ok")
            except Exception as exc:  # a failing baseline is reported, never allowed to end the whole bench
                row.update(status="error", reason=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
                           if str(exc).strip() else type(exc).__name__)
        section["rows"].append(row)
        on_row(section)

    with torch.inference_mode():
        for b in settings.batch_sizes:
            rows = all_rows[:b]
            add("kvboost", b, lambda rows=rows: measure(_kvboost(engine, rows), n, device, settings.decode_repeats))
            add("hf eager", b, lambda rows=rows: measure(_hf(model, rows, pad), n, device, settings.decode_repeats))
            if not settings.compile:
                add("hf static", b, lambda rows=rows: measure(_hf(model, rows, pad, static_len), n, device,
                                                              settings.decode_repeats))
    if settings.compile:
        _run_compiled(model, all_rows, settings, budget, pad, static_len, add)
    else:
        for b in settings.batch_sizes:
            add("hf static+compile", b, None, settings.compile_reason)
    if section["status"] == "running":
        section["status"] = "ok"
    return section


def _run_compiled(model, all_rows, settings: GpuBenchSettings, budget: Budget, pad: int, static_len: int,
                  add: Callable[..., None]) -> None:
    device = next(model.parameters()).device
    try:
        with _CompiledGenerate():  # no inference_mode: generate's own no_grad, as transformers documents it
            for b in settings.batch_sizes:
                if budget.left() < COMPILE_MIN_S:
                    add("hf static+compile", b, None, f"not started: {budget.left():.0f} s of budget left, compiling "
                                                      f"needs about {COMPILE_MIN_S:.0f} s or more")
                    continue

                def run(rows=all_rows[:b]) -> dict:
                    call = _hf(model, rows, pad, static_len, compiled=True)
                    t0 = time.perf_counter()
                    call(settings.decode_tokens)  # compiles (prefill and decode graphs) and records CUDA graphs
                    compile_s = time.perf_counter() - t0
                    return measure(call, settings.decode_tokens, device, settings.decode_repeats) | {
                        "compile_s": compile_s}

                add("hf static+compile", b, run)
    except Exception as exc:  # torch.compile itself failed to set up or to tear down
        add("hf static+compile", 0, None, f"{type(exc).__name__}: {str(exc).strip()[:300]}")
