"""A/B of attention over a block table on CPU: the in-place path (torch's CPU flash attention over the blocks where
they lie) against the gather (the context copied per layer per forward), beside the same prompt with its prefix
resident in an unpaged engine's workspace. Embedded SmolLM2, `paged_attention="table"`, the prefix stored once;
each repeat asks a new question over it (no two share a token after the prefix, and requests store nothing, so
every row reuses exactly the stored prefix: checked), the three rows in a rotated order (cache warmth favours none).

    OMP_NUM_THREADS=1 python scripts/table_attention_ab.py [--lengths 2000 7000] [--repeats 6] [--new-tokens 8]

Prints per length the median TTFT and decode step (ms) of each row.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from kvboost import KVBoost
from kvboost.model.attention import paged_backend

ROWS = ("resident", "gather", "in_place")
QUESTIONS = ("Why does", "How does", "What is in", "Where does", "Summarize", "Explain", "Quote", "List",
             "Translate", "Criticize")


def run(base: KVBoost, table: KVBoost, n: int, repeats: int, new_tokens: int) -> dict[str, float]:
    ids = base.encode(" ".join(f"word{i % 500}" for i in range(n)))[:n]
    base.clear_cache()
    table.clear_cache()
    base.warm_ids(ids)
    table.warm_ids(ids)
    in_place = paged_backend.in_place_refusal
    times: dict[str, list[float]] = {f"{row} {what}": [] for row in ROWS for what in ("ttft", "step")}
    cached: set[int] = set()
    try:
        for rep in range(repeats):
            # A first word no other question shares: every row reuses exactly the stored prefix (a question
            # sharing tokens with the last one would let the workspace, or a table's token-granular match, reuse
            # more and run a shorter forward).
            prompt = ids + base.encode(f" {QUESTIONS[rep % len(QUESTIONS)]} the text above, case {rep}?")
            order = ROWS[rep % 3:] + ROWS[:rep % 3]
            for row in order:
                paged_backend.in_place_refusal = (lambda *a, **k: "A/B: gather") if row == "gather" else in_place
                result = (base if row == "resident" else table).generate(input_ids=prompt, max_new_tokens=new_tokens)
                cached.add(result.cached_tokens)
                times[f"{row} ttft"].append(result.ttft_ms)
                times[f"{row} step"].append((result.total_ms - result.ttft_ms) / max(result.generated_tokens - 1, 1))
    finally:
        paged_backend.in_place_refusal = in_place
    medians = {k: statistics.median(v) for k, v in times.items()}
    medians["cached tokens (every row)"] = cached.pop() if len(cached) == 1 else float("nan")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000, 7000])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    base = KVBoost.from_pretrained()
    base = KVBoost(base.model, base.tokenizer, write_back=False)  # requests store nothing: the prefix stays the reuse
    table = KVBoost(base.model, base.tokenizer, paged_kv=True, paged_attention="table", memory_budget_bytes=0,
                    device_kv_budget_bytes=2 << 30, fast_path="off", write_back=False)
    print(f"torch threads {torch.get_num_threads()}")
    for n in args.lengths:
        medians = run(base, table, n, args.repeats, args.new_tokens)
        print(f"{n:>6} tokens: " + "  ".join(f"{k} {v:.1f}" for k, v in medians.items()))


if __name__ == "__main__":
    main()
