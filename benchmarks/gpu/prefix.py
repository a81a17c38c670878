"""Section b of `kvboost bench gpu`: TTFT over a long cached prefix against the suffix-only floor.

The same measurement as `kvboost bench prefix` (its SuffixFloor and workload text), cut to what a GPU run
needs: per prefix length, KVBoost with the prefix resident in its workspace, the floor (prefill of exactly
the tokens KVBoost did not reuse, over a DynamicCache already holding the rest) and full prefill. Each
measurement asks a different question, so no run is helped by the previous run's suffix.

Also "store": the same engine with its workspace forgotten first (another prompt took it), so the stored chunks
are copied into the workspace; and the "host" row (tier_rows.py: every stored chunk in the host tier), each over
the floor of its own cached tokens.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..prefix import SuffixFloor, bench_questions, fitting_lengths, prefix_text
from ..tier_rows import TierRows, tier_engines
from .settings import GpuBenchSettings
from .timing import Budget, median


def run_prefix(engine, settings: GpuBenchSettings, budget: Budget, on_row: Callable[[dict], None]) -> dict:
    lengths = fitting_lengths(settings.prefix_lengths, engine.max_context)
    section: dict = {"status": "running", "rows": [], "lengths_requested": settings.prefix_lengths,
                     "max_context": engine.max_context}
    if len(lengths) < len(settings.prefix_lengths):
        section["note"] = (f"lengths {sorted(set(settings.prefix_lengths) - set(lengths))} skipped: over the "
                           f"model's context ({engine.max_context})")
    questions = bench_questions()
    asked = 0

    def prompt_for(prefix: str) -> str:
        nonlocal asked
        asked += 1
        return f"{prefix}\n\nQuestion: {questions[asked % len(questions)]} (case {asked})\nAnswer:"

    tiers, tier_errors = tier_engines(engine, max(lengths, default=0) + 256)
    section["tier_errors"] = tier_errors
    with torch.inference_mode():
        # Longest first: the 30k row is the one with a target, so a spent budget should cost the 1k row instead.
        for n in sorted(lengths, reverse=True):
            if budget.expired():
                section["status"], section["reason"] = "truncated", f"time budget ({budget.seconds:.0f} s) spent"
                return section
            prefix = prefix_text(engine.tokenizer, n)
            engine.clear_cache()
            engine.warm(prefix)
            floor = SuffixFloor(engine.model)
            engine.generate(prompt_for(prefix), 1)  # untimed: first-call allocations at this length
            tier_rows = TierRows(tiers if not budget.expired() else {}, prefix, engine.encode(prompt_for(prefix)))
            kvb, flo, full, store = [], [], [], []
            cached = prompt_tokens = 0
            for r in range(settings.prefix_repeats):
                ids = engine.encode(prompt_for(prefix))  # both sides start from ids (the floor is handed ids)
                res = engine.generate(input_ids=ids, max_new_tokens=1)
                floor_ms, _ = floor.ttft_ms(ids, res.cached_tokens)
                kvb.append(res.ttft_ms)
                flo.append(floor_ms)
                cached, prompt_tokens = res.cached_tokens, len(ids)
                engine.forget_workspace()  # from the store: another prompt took the workspace
                ids = engine.encode(prompt_for(prefix))
                res = engine.generate(input_ids=ids, max_new_tokens=1)
                store.append(res.ttft_ms / floor.ttft_ms(ids, res.cached_tokens)[0])
                tier_rows.time(engine.encode(prompt_for(prefix)), floor)  # interleaved: drift cancels
                if r < max(1, settings.prefix_repeats // 2):  # full prefill is the slow one; fewer samples do
                    full.append(engine.generate(input_ids=engine.encode(prompt_for(prefix)), max_new_tokens=1,
                                                mode="baseline").ttft_ms)
                if budget.expired() and r + 1 < settings.prefix_repeats:
                    section["status"], section["reason"] = "truncated", "time budget spent mid-length"
                    break
            row = {"prefix_tokens": n, "prompt_tokens": prompt_tokens, "cached_tokens": cached,
                   "suffix_tokens": prompt_tokens - cached, "full_ms": median(full), "floor_ms": median(flo),
                   "kvboost_ms": median(kvb), "samples": len(kvb)}
            row["kvboost_over_floor"] = row["kvboost_ms"] / row["floor_ms"] if row["floor_ms"] > 0 else float("nan")
            row["store_over_floor"] = median(store)
            tier_rows.into(row)
            section["rows"] = sorted([*section["rows"], row], key=lambda r: r["prefix_tokens"])
            del floor  # its cache copy of the prefix: up to ~1 GB at 30k tokens on a 3B model
            if engine.device.type == "cuda":
                torch.cuda.empty_cache()
            on_row(section)
    if section["status"] == "running":
        section["status"] = "ok"
    return section
