"""A/B in one process: a batch runner whose ragged verify runs compiled (new) against one whose ragged verify runs
the eager fixed-shape buckets as before (old), same engine, same prompts, interleaved rounds."""
import time, types, torch
from kvboost import KVBoost
from kvboost.batch import BatchRunner
from kvboost.model import runner as runner_mod
from kvboost.bench.workloads import load_spec_tasks

engine = KVBoost.from_pretrained(fast_path="compiled", speculative="prompt_lookup")
new = BatchRunner(engine, max_batch_size=4)
old = BatchRunner(engine, max_batch_size=4)
steps = old.steps
# old behaviour: ragged verifies through the eager buckets (2/4/8/16 widths, bucketed rows)
orig_runs = steps._runs_compiled
steps._runs_compiled = lambda key: orig_runs(key) and key[0] != "rows_verify"
def old_rows(self, n):
    return runner_mod.batch_bucket_for(n, self.workspace.batch_size) if self.workspace.base == 0 else None
steps._verify_rows = types.MethodType(old_rows, steps)
def old_width(self, n_rows, width):
    rows = self._verify_rows(n_rows)
    if rows is None: return None
    widths = [w for w in runner_mod.VERIFY_WIDTHS if rows * w <= runner_mod.MAX_VERIFY_STEP_TOKENS]
    return next((w for w in widths if w >= width), widths[-1] if widths else None)
steps.verify_width = types.MethodType(old_width, steps)
steps.prepare_batched_verify = lambda: None

tasks = load_spec_tasks()
def batch(runner, ids_list, spec, n=64):
    reqs = [engine.request(input_ids=ids, max_new_tokens=n, speculative=spec) for _ in range(3) for ids in ids_list]
    hs = [runner.add(r) for r in reqs]
    t = time.perf_counter()
    while runner.has_work(): runner.step()
    dt = time.perf_counter() - t
    res = [h.result for h in hs]
    return sum(r.generated_tokens for r in res) / dt, [r.output_token_ids for r in res]

warm = engine.encode("hello there, how are you today?")
for r in (new, old):  # compiles (rows, rows_verify for new) outside the timing
    batch(r, [warm, warm], "prompt_lookup", 8)
for w in ("extract", "code", "rag", "chat"):
    ids_list = [engine.encode(messages=t["messages"]) for t in tasks if t["workload"] == w]
    for ids in ids_list:
        engine.generate(input_ids=ids, max_new_tokens=2)  # prompts stored: every timed batch reuses them
    rates = {}
    outs = {}
    for rnd in range(3):
        for name, r in (("new", new), ("old", old)) if rnd % 2 == 0 else (("old", old), ("new", new)):
            for spec in ("off", "prompt_lookup"):
                tps, o = batch(r, ids_list, spec)
                rates.setdefault((name, spec), []).append(tps)
                outs.setdefault(spec, o)
                assert o == outs["off"], (w, name, spec)
    m = {k: sum(v) / len(v) for k, v in rates.items()}
    print(f"{w}: plain new {m['new','off']:.1f} old {m['old','off']:.1f} | lookup new {m['new','prompt_lookup']:.1f} "
          f"old {m['old','prompt_lookup']:.1f} | lookup/plain new {m['new','prompt_lookup']/m['new','off']:.2f}x "
          f"old {m['old','prompt_lookup']/m['old','off']:.2f}x | new/old lookup {m['new','prompt_lookup']/m['old','prompt_lookup']:.2f}x",
          flush=True)
print("verify steps", {k: v for k, v in new.steps.stats.as_dict().items()}, {k: v for k, v in old.steps.stats.as_dict().items()})
