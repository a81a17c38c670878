"""A/B, in one process: a batch runner whose ragged verifies run compiled (fast_path="compiled" on a speculating
engine, as now) against one whose ragged verifies run the eager fixed-shape buckets (2/4/8/16 tokens per row, rows
rounded up to 2/4/8/16), as before session 20. Same engine and model, same prompts (the shipped spec workloads, 4
prompts x 3 copies queued into 4 rows, 64 greedy tokens each), rounds interleaved; every batch's outputs are checked
equal to the batch without speculation. The "old" runner is the same class with its steps' compiled-kind test,
row count and width choice put back to what they were (instance patches, below).

    OMP_NUM_THREADS=2 python scripts/compiled_batched_verify_ab.py

Session 20 (SmolLM2-135M fp32, 2 threads, 2-core VM), two runs. Batch tok/s with prompt lookup, new / old:
  run 1: extract 205.1 / 154.6 (1.33x), code 183.7 / 162.9 (1.13x), rag 122.4 / 123.4, chat 162.6 / 161.4;
  run 2: extract 193.9 / 161.2 (1.20x), code 190.0 / 201.2 (0.94x), rag 134.8 / 143.8 (0.94x), chat 184.3 / 185.5.
Over the same batches without speculation through the same runner, new / old: run 1 1.26 / 0.94, 1.11 / 0.90,
0.97 / 0.98, 0.97 / 0.97; run 2 1.10 / 0.93, 0.92 / 0.98, 0.93 / 1.00, 0.97 / 0.98. Extract gains in both; code and
rag disagree between runs by more than the difference (their plain batches moved 10-20% between runs).
"""
from __future__ import annotations

import time
import types

from kvboost import KVBoost
from kvboost.batch import BatchRunner
from kvboost.bench.workloads import load_spec_tasks
from kvboost.model import runner as runner_mod

ROUNDS = 3
COPIES = 3


def as_before(runner: BatchRunner) -> None:
    """The runner's ragged verifies through the eager fixed-shape buckets, as before the compiled batched verify."""
    steps = runner.steps
    compiled_kind = steps._runs_compiled  # noqa: SLF001 - this A/B puts the previous behaviour back
    steps._runs_compiled = lambda key: compiled_kind(key) and key[0] != "rows_verify"  # noqa: SLF001

    def verify_rows(self, n_rows):
        return runner_mod.batch_bucket_for(n_rows, self.workspace.batch_size) if self.workspace.base == 0 else None

    def verify_width(self, n_rows, width):
        rows = self._verify_rows(n_rows)  # noqa: SLF001
        if rows is None:
            return None
        widths = [w for w in runner_mod.VERIFY_WIDTHS if rows * w <= runner_mod.MAX_VERIFY_STEP_TOKENS]
        return next((w for w in widths if w >= width), widths[-1] if widths else None)

    steps._verify_rows = types.MethodType(verify_rows, steps)  # noqa: SLF001
    steps.verify_width = types.MethodType(verify_width, steps)
    steps.prepare_batched_verify = lambda: None


def batch(engine, runner: BatchRunner, prompts: list[list[int]], spec: str, new_tokens: int = 64):
    """(batch tok/s, every row's tokens): COPIES requests of each prompt queued at once."""
    handles = [runner.add(engine.request(input_ids=ids, max_new_tokens=new_tokens, speculative=spec))
               for _ in range(COPIES) for ids in prompts]
    t0 = time.perf_counter()
    while runner.has_work():
        runner.step()
    seconds = time.perf_counter() - t0
    results = [h.result for h in handles]
    return sum(r.generated_tokens for r in results) / seconds, [r.output_token_ids for r in results]


def main() -> None:
    engine = KVBoost.from_pretrained(fast_path="compiled", speculative="prompt_lookup")
    runners = {"new": BatchRunner(engine, max_batch_size=4), "old": BatchRunner(engine, max_batch_size=4)}
    as_before(runners["old"])
    hello = engine.encode("hello there, how are you today?")
    for runner in runners.values():  # what compiles (the rows step; the new runner's batched verify), untimed
        batch(engine, runner, [hello, hello], "prompt_lookup", 8)
    tasks = load_spec_tasks()
    for workload in ("extract", "code", "rag", "chat"):
        prompts = [engine.encode(messages=t["messages"]) for t in tasks if t["workload"] == workload]
        for ids in prompts:
            engine.generate(input_ids=ids, max_new_tokens=2)  # stored: every timed batch reuses its prompt
        rates: dict[tuple[str, str], list[float]] = {}
        plain_tokens = None
        for round_ in range(ROUNDS):
            order = ("new", "old") if round_ % 2 == 0 else ("old", "new")
            for name in order:
                for spec in ("off", "prompt_lookup"):
                    rate, tokens = batch(engine, runners[name], prompts, spec)
                    plain_tokens = plain_tokens or tokens
                    assert tokens == plain_tokens, (workload, name, spec)
                    rates.setdefault((name, spec), []).append(rate)
        m = {key: sum(v) / len(v) for key, v in rates.items()}
        print(f"{workload}: tok/s without speculation new {m['new', 'off']:.1f} old {m['old', 'off']:.1f} | "
              f"prompt lookup new {m['new', 'prompt_lookup']:.1f} old {m['old', 'prompt_lookup']:.1f} "
              f"({m['new', 'prompt_lookup'] / m['old', 'prompt_lookup']:.2f}x) | over no speculation "
              f"new {m['new', 'prompt_lookup'] / m['new', 'off']:.2f}x old "
              f"{m['old', 'prompt_lookup'] / m['old', 'off']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
