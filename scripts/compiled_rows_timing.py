"""What a batched decode step (a batch runner's "rows" step) costs with fast_path="compiled" against the same step
run eagerly (fast_path="eager": the same static path, not compiled).

Times BatchRunner steps (model/runner.py decode_batch) over rows ~300 tokens long at 1-8 rows: the first call
(the compiled runner compiles its one rows graph there) and the median of 9 after it.

    OMP_NUM_THREADS=1 python scripts/compiled_rows_timing.py [--threads 1] [--model PATH] [--length 300]
                                                             [--rows 2 3 4 8 1] [--modes eager compiled]

Session 19 (SmolLM2-135M fp32, 1 thread, 2-core AMD EPYC VM): 2 / 3 / 4 / 5 / 8 rows 22.3 / 26.8 / 28.0 / 52.8 /
67.1 ms compiled (at the exact row count); eagerly 2 / 3 / 4 / 8 rows took 41.7-52.3 / 60.7 / 59.3-66.7 /
107.0-120.5 ms in two runs (3 rows in the 4-row bucket). The compile took 86-95 s, and no later row count
compiled. At 2 threads with rows ~1,000 tokens long (--length 1000), 4 rows took 30 ms compiled.

The jump from 4 to 5 rows is the packed GEMM's: inductor's C++ template over SmolLM2's weight shapes alone
measured 5.2 ms at 1-4 rows and 11-19 ms at 5-8 (1 thread), and at 2 threads 3.7-4.2 ms at 1-4, 9-10 ms at 5-8
and 7.4-8.2 ms at 9-12 rows: cheaper at 9-12 rows than at 5-8, so it is the template's blocking, not the bytes.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def time_rows(model: str | None, mode: str, row_counts: list[int], length: int) -> None:
    from kvboost import KVBoost
    from kvboost.batch import BatchRunner

    engine = KVBoost.from_pretrained(model, fast_path=mode)
    runner = BatchRunner(engine, max_batch_size=max(row_counts))
    steps = runner.steps
    assert steps is not None
    runner.ws.ensure_capacity(length + 1024, keep=0)  # room for the rows' positions (a prefill would make it)
    with torch.inference_mode():
        for rows in row_counts:
            lengths = [length + 7 * i for i in range(rows)]  # K/V content does not change the cost: left as is
            t0 = time.perf_counter()
            steps.decode_batch([5] * rows, lengths)
            first = time.perf_counter() - t0
            times = []
            for j in range(9):
                t0 = time.perf_counter()
                steps.decode_batch([5] * rows, [n + j + 1 for n in lengths])
                times.append((time.perf_counter() - t0) * 1e3)
            print(f"{mode:>8}: {rows} rows  first call {first:6.1f} s  median {statistics.median(times):6.1f} ms",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 3, 4, 8, 1])
    parser.add_argument("--length", type=int, default=300, help="tokens before each row's step")
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for mode in args.modes:
        time_rows(args.model, mode, args.rows, args.length)


if __name__ == "__main__":
    main()
