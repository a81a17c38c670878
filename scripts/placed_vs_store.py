"""TTFT of a stored prefix placed into a forgotten workspace: paged KV's default mode (blocks copied in) against the
unpaged engine (chunks copied from its memory tier), interleaved in one process on the embedded SmolLM2-135M, so
the machine's drift between the bench's rows (timed minutes apart) does not enter the comparison.

    python scripts/placed_vs_store.py [--prefix 4000] [--rounds 3] [--threads 1] [--profile]
"""
from __future__ import annotations

import argparse
import statistics

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="also print the top ops of one request each")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from kvboost import KVBoost
    from kvboost.bench.prefix import prefix_text
    from kvboost.cli_common import load_engine

    unpaged = load_engine(None, fast_path="off")
    paged = KVBoost(unpaged.model, unpaged.tokenizer, chunk_size=unpaged.config.chunk_size, paged_kv=True,
                    memory_budget_bytes=0, device_kv_budget_bytes=4 << 30, fast_path="off")
    engines = {"unpaged store": unpaged, "paged placed": paged}
    prefix = prefix_text(unpaged.tokenizer, args.prefix)
    asked = 0

    def ttft(engine: KVBoost) -> tuple[float, int]:
        nonlocal asked
        asked += 1
        ids = engine.encode(f"{prefix}\n\nQuestion: what is item {asked}?\nAnswer:")
        engine.forget_workspace()  # the prefix comes from the stored chunks / blocks
        result = engine.generate(input_ids=ids, max_new_tokens=1)
        return result.ttft_ms, result.cached_tokens

    times: dict[str, list[float]] = {name: [] for name in engines}
    with torch.inference_mode():
        for engine in engines.values():
            engine.warm(prefix)
            ttft(engine)  # untimed: first-call allocations
        for _ in range(args.rounds):
            for name, engine in engines.items():
                for _ in range(3):
                    ms, cached = ttft(engine)
                    times[name].append(ms)
        base = statistics.median(times["unpaged store"])
        for name, values in times.items():
            print(f"{name:>14}: median {statistics.median(values):7.1f} ms over {len(values)} requests "
                  f"({statistics.median(values) / base:.3f}x unpaged), {cached} cached tokens")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            for name, engine in engines.items():
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    ttft(engine)
                print(name)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
