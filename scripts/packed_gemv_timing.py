"""Time one decode step's matrix-vector products on CPU: every Linear weight of the embedded SmolLM2-135M applied
to a one-row input, ATen's kernels (eager and compiled) against inductor's packed C++ GEMM kernels (compiled with
frozen weights, as fast_path="compiled" runs the decode step: model/compiled_step.py), side by side in one
process, with a plain read of 1 GiB (`x.sum()`) as the memory-bandwidth reference.

    python scripts/packed_gemv_timing.py [--threads 2] [--repeats 10]

The packed variant compiles for about a minute.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch


def seconds(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from kvboost.cli_common import load_engine
    from kvboost.model.compiled_step import CompiledStep, linear_weight_bytes

    model = load_engine(None, fast_path="off").model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(1, 1, m.in_features) for m in linears}
    weight_bytes = linear_weight_bytes(model)

    def products() -> list[torch.Tensor]:
        return [m(inputs[m.in_features]) for m in linears]

    big = torch.randn(1 << 28)  # 1 GiB of fp32
    rows = {"x.sum() over 1 GiB": (seconds(big.sum, 3), big.numel() * 4)}
    with torch.inference_mode():
        rows["ATen, eager"] = (seconds(products, args.repeats), weight_bytes)
        torch._dynamo.reset()
        aten = CompiledStep(products, packed=False)
        rows["ATen, compiled"] = (seconds(aten, args.repeats), weight_bytes)
        torch._dynamo.reset()
        packed = CompiledStep(products)
        start = time.perf_counter()
        packed()
        compile_s = time.perf_counter() - start
        name = "packed, compiled" if packed.packed else f"packed failed ({packed.fallback})"
        rows[name] = (seconds(packed, args.repeats), weight_bytes)
    print(f"{len(linears)} Linear products, {weight_bytes / 1e6:.0f} MB of weights, {args.threads} threads "
          f"(packed compile {compile_s:.0f} s)")
    for name, (s, nbytes) in rows.items():
        print(f"{name:>22}: {s * 1e3:8.2f} ms  {nbytes / s / 1e9:6.1f} GB/s")


if __name__ == "__main__":
    main()
