"""What a speculative verify of n tokens costs with fast_path="compiled", against the compiled decode step.

An engine that speculates compiles its verify step at load (model/runner.py, compile_verify). This times, over a
~300-token prompt in the workspace, the compiled decode step (n = 1), the compiled verify at n = 2..10 tokens, and
the eager verify a compiled engine that does not speculate runs (padded to the 16-token bucket): medians of 15.

    OMP_NUM_THREADS=1 python scripts/compiled_verify_timing.py [--threads 1] [--model PATH]

Session 18 (SmolLM2-135M fp32, 1 thread, 2-core AMD EPYC VM): decode 18.3 ms; verify 21.5 / 23.8 / 22.8 ms at
2-4 tokens (1.17-1.30x), 45.4-46.9 at 5-8 (~2.5x), 54.9 / 56.4 at 9 / 10; loaded in 116 s (47 s without the
verify step), whose eager verify (16-token bucket) took 97.8-98.9 ms, 5.4x its decode step.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def median_ms(fn, repeats: int = 15) -> float:
    fn(0)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i + 1)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_engine(model: str | None, speculates: bool) -> None:
    from kvboost import KVBoost

    prompt = list(range(1000, 1300))
    t0 = time.perf_counter()
    engine = KVBoost.from_pretrained(model, fast_path="compiled", speculative="prompt_lookup" if speculates else None)
    runner = engine.runner
    print(f"speculative={'prompt_lookup' if speculates else None}: loaded in {time.perf_counter() - t0:.0f} s, "
          f"compiled steps {runner.compiled_steps}, {runner.decode_kernels}")
    with torch.inference_mode():
        runner.forward(prompt[:256], 0)
        runner.forward(prompt[256:], 256)
        start = len(prompt)
        decode = median_ms(lambda i: runner.forward([5], start + i))
        print(f"  decode step: {decode:.1f} ms")
        for n in range(2, 11) if speculates else (2, 9):
            ms = median_ms(lambda i, n=n: runner.verify([5] * n, start + i))
            print(f"  verify of {n:2d} tokens: {ms:6.1f} ms ({ms / decode:.2f}x the decode step)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for speculates in (True, False):
        time_engine(args.model, speculates)


if __name__ == "__main__":
    main()
