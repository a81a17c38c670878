"""Replay prompt-lookup speculation over the shipped spec workloads without timing anything.

Greedy output does not depend on speculation, so each workload prompt's 64-token greedy output is generated once
(embedded SmolLM2, cached in a JSON file); then the real PromptLookup and AdaptiveK (kvboost.decoding) are driven
step by step over it, with each forward of n tokens charged a fixed cost from a measured profile (--profile):

* cpu_linear-1t / cpu_linear-2t (default: 1t): SmolLM2-135M over ~300 cached tokens with `cpu_linear` (session 12,
  median of 7 forwards of n tokens at 1 / 2 torch threads);
* compiled-1t / compiled-2t: fast_path="compiled" with its verify step compiled (session 18, 1 / 2 threads,
  medians of 15 forwards
  of n tokens over ~300 cached tokens; scripts/compiled_verify_timing.py measures the same);
* session7: the same model before `cpu_linear`, 1 thread (1 token 107 ms, 2-9 tokens 195-223 ms, more 244 ms).

The estimated speed-up is (tokens x a plain step's cost) / the charged total, per workload. Deterministic, so
policies can be compared in seconds; the real figures come from `kvboost bench spec` (on session 12's code the
replay estimated rag / code / extract / chat 1.27 / 2.23 / 3.10 / 1.01x at 1 thread, and the bench measured
1.29 / 2.19 / 3.21 / 1.03x).

    python scripts/spec_replay.py [--refs /tmp/kvboost_spec_refs.json] [--min-ngram auto 1 2 3] [--cold]
                                  [--profile cpu_linear-1t] [--oracle 8 15]

Where the bench reads lower than the replay (session 18: compiled, 1 thread, extract 2.69x against 2.86x), the
profile is the difference, not the policy: replayed with the step costs the engine measured in a bench-like run
(session 20: plain 21.0 ms, verifies of 2-9 tokens 23.4 / 27.0 / 26.1 / 41.9 / 42.5 / 53.1 / 53.8 / 60.4 ms, over
~1,000 cached tokens where the profiles have ~300), the replay took 65 verifies of 216 drafts keeping 184, the
engine 68 of 215 keeping 182, and estimated 2.67x against the run's 2.55x, whose times include the 4 prefills
(2.63x without them).

--oracle K prints an upper bound for any prompt-lookup policy (perfect choice among every earlier occurrence of
the last token, drafts of up to K tokens, none rejected) on the same outputs and costs.

--cold starts every request's step costs from nothing (as before they were kept per engine); by default the
costs measured by one request carry to the next, as the engine now does.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvboost.decoding.prompt_lookup import PromptLookup
from kvboost.decoding.speculative import AdaptiveK, StepCosts, lookup_min_ngram

# ms per forward of n tokens (1..10); longer forwards cost what 10 did.
PROFILES = {
    "cpu_linear-1t": (34.9, 35.9, 45.4, 39.2, 64.3, 65.4, 73.0, 67.8, 75.5, 75.8),
    "cpu_linear-2t": (22.9, 24.2, 28.3, 25.5, 33.5, 38.5, 43.7, 44.3, 51.1, 60.5),
    "compiled-1t": (19.0, 19.7, 23.5, 22.8, 43.9, 43.9, 46.1, 43.9, 52.7, 52.3),
    "compiled-2t": (14.8, 16.0, 17.4, 16.4, 23.0, 25.0, 25.0, 27.0, 29.8, 30.1),
    "session7": (107.0, *(195.0 + 28.0 * i / 7 for i in range(8)), 244.0),
}
PROFILE = PROFILES["cpu_linear-1t"]


def step_cost(n_tokens: int) -> float:
    return PROFILE[min(n_tokens, len(PROFILE)) - 1] / 1e3


def references(path: Path, new_tokens: int) -> list[dict]:
    if path.exists():
        return json.loads(path.read_text())
    from kvboost import KVBoost
    from kvboost.bench.workloads import load_spec_tasks

    engine = KVBoost.from_pretrained()
    refs = []
    for task in load_spec_tasks():
        ids = engine.encode(messages=task["messages"])
        out = engine.generate(input_ids=ids, max_new_tokens=new_tokens).output_token_ids
        refs.append({"workload": task["workload"], "prompt": ids, "output": out})
    path.write_text(json.dumps(refs))
    return refs


def replay(refs: list[dict], min_ngram: int | None, carry: bool, k_max: int = 8) -> dict[str, float]:
    """min_ngram None: the engine's default "auto" (lookup_min_ngram over the costs measured so far)."""
    totals: dict[str, list[float]] = {}
    costs = StepCosts()
    for ref in refs:
        prompt, out = ref["prompt"], ref["output"]
        lookup = PromptLookup(prompt, 3, min_ngram or 1, capacity=len(out) + k_max)
        policy = AdaptiveK(k_max, costs=costs if carry else StepCosts())
        lookup.extend(out[:1])  # the first token comes from the prefill
        i, charged = 1, 0.0
        while i < len(out):
            budget = len(out) - i
            k = policy.next_k(budget - 1)
            floor = lookup_min_ngram(policy.costs) if min_ngram is None else None
            drafts = lookup.propose(k, floor) if k > 0 else []
            kept = 0
            while kept < len(drafts) and drafts[kept] == out[i + kept]:
                kept += 1
            charged += step_cost(1 + len(drafts))
            policy.timed(1 + len(drafts), step_cost(1 + len(drafts)))
            if drafts:
                policy.update(len(drafts), kept)
            advance = min(kept + 1, budget)
            lookup.extend(out[i:i + advance])
            i += advance
        t = totals.setdefault(ref["workload"], [0.0, 0.0])
        t[0] += (len(out) - 1) * step_cost(1)
        t[1] += charged
    return {w: plain / charged for w, (plain, charged) in totals.items()}


def oracle(refs: list[dict], k_max: int = 8) -> dict[str, float]:
    """An upper bound for every prompt-lookup policy on these outputs and step costs: each step drafts exactly the
    longest continuation (<= k_max) that follows *any* earlier occurrence of the last token and agrees with the
    output, so no draft is ever rejected and k is always right. (Any n-gram lookup proposes the continuation of
    some occurrence of the last token: an n-gram match is one of them.)"""
    totals: dict[str, list[float]] = {}
    for ref in refs:
        prompt, out = ref["prompt"], ref["output"]
        ctx = list(prompt) + out[:1]  # the first token comes from the prefill
        i, charged = 1, 0.0
        while i < len(out):
            budget = len(out) - i
            best = 0
            for s in (j for j in range(len(ctx) - 1) if ctx[j] == ctx[-1]):
                m = 0
                while m < min(k_max, budget - 1) and s + 1 + m < len(ctx) and ctx[s + 1 + m] == out[i + m]:
                    m += 1
                best = max(best, m)
            charged += step_cost(1 + best)
            ctx += out[i:i + best + 1]
            i += best + 1
        t = totals.setdefault(ref["workload"], [0.0, 0.0])
        t[0] += (len(out) - 1) * step_cost(1)
        t[1] += charged
    return {w: plain / charged for w, (plain, charged) in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refs", type=Path, default=Path("/tmp/kvboost_spec_refs.json"))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--min-ngram", nargs="+", default=["auto", "1", "2", "3"],
                        help="shortest n-grams to replay: integers, or auto (the engine's default)")
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu_linear-1t")
    parser.add_argument("--oracle", type=int, nargs="*", metavar="K",
                        help="also print the bound no prompt-lookup policy can pass (drafts of up to K tokens)")
    args = parser.parse_args()
    global PROFILE
    PROFILE = PROFILES[args.profile]
    refs = references(args.refs, args.new_tokens)
    for n in args.min_ngram:
        est = replay(refs, None if n == "auto" else int(n), carry=not args.cold)
        print(f"min_ngram {n}, {'cold' if args.cold else 'carried'} costs: "
              + "  ".join(f"{w} {v:.2f}x" for w, v in est.items()))
    for k in args.oracle or ():
        print(f"oracle lookup, drafts <= {k}: " + "  ".join(f"{w} {v:.2f}x" for w, v in oracle(refs, k).items()))


if __name__ == "__main__":
    main()
