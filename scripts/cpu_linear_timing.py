"""Time what `cpu_linear` (model/cpu_linear.py) changes, at torch's current thread count.

1. products: all Linear products of one forward of n token rows, x @ W^T (the model's own) against W @ x^T (one
   row as two equal columns), on random weights of SmolLM2-135M's 211 shapes and of 4 Qwen2.5-1.5B layers;
   best of 3, ms.
2. engine (unless --no-engine): the embedded model's decode step (64 tokens after a ~150-token code prompt) and
   generate_batch of 2 / 4 / 8 prompts x 48 tokens, with cpu_linear as installed and with the model's own
   products (`model_own_products`), alternating in one process.

    OMP_NUM_THREADS=1 python scripts/cpu_linear_timing.py
    python scripts/cpu_linear_timing.py --threads 2
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from timing_utils import best_ms  # scripts/, on the path when run as a script

SMOLLM2 = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30 + [
    (49152, 576)]
QWEN_1_5B = [(1536, 1536), (256, 1536), (256, 1536), (1536, 1536), (8960, 1536), (8960, 1536), (1536, 8960)] * 4


def products(shapes: list[tuple[int, int]], rows: list[int]) -> None:
    weights = [torch.randn(s) for s in shapes]
    for n in rows:
        xs = {k: torch.randn(n, k) for k in {s[1] for s in shapes}}
        cols = {k: (x if n > 1 else torch.cat((x, x))) for k, x in xs.items()}
        own = best_ms(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights], trials=3, warm=False)
        wx = best_ms(lambda cols=cols: [torch.mm(w, cols[w.shape[1]].t()) for w in weights], trials=3, warm=False)
        print(f"  {n:2d} rows: x @ W^T {own:7.1f} ms   W @ x^T {wx:7.1f} ms")


def engine_ab() -> None:
    from kvboost import KVBoost
    from kvboost.bench.workloads import load_spec_tasks
    from kvboost.model.cpu_linear import model_own_products

    engine = KVBoost.from_pretrained()
    print(f"engine: {engine.cpu_linear}")
    tasks = load_spec_tasks()
    prompts = [engine.encode(messages=t["messages"]) for t in tasks]
    code = next(p for p, t in zip(prompts, tasks) if t["workload"] == "code")
    engine.generate(input_ids=code, max_new_tokens=2)

    def decode() -> float:
        r = engine.generate(input_ids=code, max_new_tokens=64)
        return (r.total_ms - r.ttft_ms) / (r.generated_tokens - 1)

    def batch(rows: list[list[int]]) -> float:
        t0 = time.perf_counter()
        results = engine.generate_batch(input_ids=rows, max_new_tokens=48)
        return sum(r.generated_tokens for r in results) / (time.perf_counter() - t0)

    for _ in range(2):
        with model_own_products(engine.model):
            own = decode()
        print(f"decode step: own products {own:.1f} ms, cpu_linear {decode():.1f} ms")
    for b in (2, 4, 8):
        rows = prompts[:b]
        engine.generate_batch(input_ids=rows, max_new_tokens=2)  # prompts resident in the store
        for _ in range(2):
            with model_own_products(engine.model):
                own = batch(rows)
            print(f"generate_batch {b} x 48 tokens (prefill of reused prompts included): own products "
                  f"{own:.1f} tok/s, cpu_linear {batch(rows):.1f} tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads first")
    parser.add_argument("--no-engine", action="store_true", help="products only (no model load)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, MKL {torch.backends.mkl.is_available()}")
    with torch.inference_mode():
        print("SmolLM2-135M, 211 weights:")
        products(SMOLLM2, [1, 2, 3, 4, 5, 6, 8, 9, 12, 16])
        print("Qwen2.5-1.5B, 4 layers:")
        products(QWEN_1_5B, [1, 2, 4, 5, 8, 9, 12, 16])
    if not args.no_engine:
        engine_ab()


if __name__ == "__main__":
    main()
