"""`kvboost bench spec`: speculative decoding, greedy, on grounded workloads and open chat, side by side in one run.

Systems, on the same prompts (spec_tasks.jsonl: RAG answers quoting their document, code edits of a function in
the prompt, extraction from a text, open chat):

* kvboost: no speculation (the reference: "identical" compares each system's tokens with its tokens);
* prompt_lookup: KVBoost with n-gram drafts;
* draft: KVBoost with a draft model. No real draft/target pair ships, so by default the draft is a tiny random
  model sharing the tokenizer: its drafts are almost never accepted, and only exactness and the cost of
  verification (how much slower than no speculation) are meaningful. --draft-model takes a real one;
* hf_prompt_lookup: Hugging Face `generate(prompt_lookup_num_tokens=k)` with a plain DynamicCache;
* with --batch-runner, batched / batched_prompt_lookup: the same request as a row of the continuous-batching runner
  (kvboost serve's batching worker), alone in it, without and with prompt lookup; and together /
  together_prompt_lookup: a workload's prompts as rows of one batch at once (a busy server: rows verify their drafts
  in ragged steps): TOGETHER_COPIES requests of each prompt queued at once into a runner of max(4, --per-workload)
  rows, so rows join as others leave (continuous batching under load). Decode tok/s is the batch's: every row's decode
  tokens over the wall time from the first token to the last row's end (the joining rows' prefills included: the
  prompts are resident, and both systems pay the same). Run TOGETHER_ROUNDS times, alternating the two.

Decode tok/s = (generated - 1) / (total - time to first token): prefill and reuse are left out, so only the
decode loop is compared. HF's time to first token is measured by a 1-token generate of the same prompt.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from .console import bench_console
from .model_options import DeviceOption, DtypeOption, ModelOption, ShapeOption, load_engine, model_choice

SYSTEMS = ("kvboost", "prompt_lookup", "draft", "hf_prompt_lookup")
BATCH_SYSTEMS = ("batched", "batched_prompt_lookup")
TOGETHER_SYSTEMS = {"together": "off", "together_prompt_lookup": "prompt_lookup"}
TOGETHER_COPIES = 3  # requests per prompt in a together run's queue
TOGETHER_ROUNDS = 2  # together runs per system, alternating (one is a few seconds: drift averages out)


@dataclass
class Sample:
    workload: str
    system: str
    generated: int
    decode_s: float
    identical: bool
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class Row:
    workload: str
    system: str
    prompts: int
    decode_tok_s: float
    speedup: float  # decode tok/s over kvboost's (no speculation), same workload
    acceptance: float | None
    identical_rate: float
    samples: list[dict[str, Any]] = field(default_factory=list)


def tiny_random_draft(tokenizer, device, dtype):
    """A 2-layer random Llama sharing the tokenizer: drafts for measuring exactness and verification cost only."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device).eval()


def _hf_decode(model, ids, max_new_tokens: int, k: int, eos: list[int]) -> tuple[list[int], float]:
    import torch

    from kvboost.model.cpu_linear import model_own_products

    x = torch.tensor([ids], device=model.device)
    common = dict(do_sample=False, eos_token_id=eos, pad_token_id=eos[0] if eos else None)
    # Plain transformers as users run it: the model's own Linear products, not the engine's (cpu_linear).
    with torch.inference_mode(), model_own_products(model):
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=1, prompt_lookup_num_tokens=k, **common)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(x, max_new_tokens=max_new_tokens, prompt_lookup_num_tokens=k, **common)
        total = time.perf_counter() - t0
    tokens = out[0, len(ids):].tolist()
    return tokens, max(total - ttft, 1e-9)


def run_spec_bench(choice, max_new_tokens: int = 64, per_workload: int = 4, k: int = 8,
                   draft_model: str | None = None, json_path: str | None = None, plot_path: str | None = None,
                   console: Console | None = None, min_ngram: int | None = None, max_ngram: int = 3,
                   batch_runner: bool = False, fast_path: str | None = None) -> list[Row]:
    import torch

    from kvboost.decoding.factory import make_draft_engine
    from kvboost.scheduler import Scheduler

    from .workloads import load_spec_tasks

    console = console or bench_console()
    # Every request below names its own speculation; the engine's default makes its runner ready a verify step at
    # load (captured with graphs, compiled with fast_path="compiled"), as a speculating server's engine is.
    engine = load_engine(choice, num_speculative_tokens=k, prompt_lookup_max_ngram=max_ngram,
                         prompt_lookup_min_ngram=min_ngram, speculative="prompt_lookup",
                         **({"fast_path": fast_path} if fast_path else {}))
    fast = engine.cache_stats()["fast_path"]
    console.print(f"fast path: {fast['mode']} ({fast['reason']})")
    param = next(engine.model.parameters())
    draft_note = draft_model or "tiny random 2-layer Llama sharing the tokenizer (exactness and cost only)"
    draft = draft_model or tiny_random_draft(engine.tokenizer, param.device, param.dtype)
    engine.draft = make_draft_engine(engine, draft)  # what draft_model= builds, after the target has loaded
    tasks = load_spec_tasks()
    by_workload: dict[str, list[dict]] = {}
    for t in tasks:
        by_workload.setdefault(t["workload"], []).append(t)
    eos = sorted(engine.eos_token_ids)
    systems = SYSTEMS + (BATCH_SYSTEMS if batch_runner else ())
    # One runner, as a server keeps it (its measured step costs carry over from prompt to prompt).
    runner = Scheduler(engine, max_batch_size=max(4, per_workload)) if batch_runner else None
    if runner is not None:  # its first steps compile (fast_path="compiled": the batched decode and verify steps)
        _run_alone(runner, engine.request(input_ids=engine.encode("Hello"), max_new_tokens=4))
    samples: list[Sample] = []
    step_costs: dict[str, dict] = {}  # per workload: the engine's measured step costs per method after it ran
    for workload, items in by_workload.items():
        refs: list[tuple[list[int], list[int] | None]] = []  # (prompt ids, kvboost's tokens) per task
        for task in items[:per_workload]:
            ids = engine.encode(messages=task["messages"])
            engine.generate(input_ids=ids, max_new_tokens=2)  # prompt resident; warm caches
            ref = None
            for system in systems:
                if system == "hf_prompt_lookup":
                    tokens, decode_s = _hf_decode(engine.model, ids, max_new_tokens, k, eos)
                    kept = tokens[:-1] if tokens and tokens[-1] in eos else tokens  # KVBoost reports no EOS
                    s = Sample(workload, system, len(tokens), decode_s, kept == ref)
                else:
                    spec = {"kvboost": "off", "prompt_lookup": "prompt_lookup", "draft": "draft", "batched": "off",
                            "batched_prompt_lookup": "prompt_lookup"}[system]
                    if system in BATCH_SYSTEMS:
                        assert runner is not None
                        r = _run_alone(runner, engine.request(input_ids=ids, max_new_tokens=max_new_tokens,
                                                              speculative=spec))
                    else:
                        r = engine.generate(input_ids=ids, max_new_tokens=max_new_tokens, speculative=spec)
                    tokens = r.output_token_ids
                    if system == "kvboost":
                        ref = tokens
                    s = Sample(workload, system, r.generated_tokens, max((r.total_ms - r.ttft_ms) / 1e3, 1e-9),
                               tokens == ref, r.draft_tokens, r.accepted_tokens)
                samples.append(s)
            console.print(f"{task['id']}: " + ", ".join(
                f"{x.system} {(x.generated - 1) / x.decode_s:.1f} tok/s" for x in samples[-len(systems):]))
            refs.append((ids, ref))
        if runner is not None:  # one batch is a few seconds: repeated, alternating, to average out drift
            for _ in range(TOGETHER_ROUNDS):
                for system, spec in TOGETHER_SYSTEMS.items():
                    samples += _run_together(runner, workload, system, refs, max_new_tokens, spec)
            rates = {system: _rows([x for x in samples if x.workload == workload], ("kvboost", system))[1]
                     for system in TOGETHER_SYSTEMS}
            console.print(f"{workload}, {len(refs)} prompts x {TOGETHER_COPIES} through {runner.max_batch_size} "
                          "rows: " + ", ".join(
                f"{system} {row.decode_tok_s:.1f} tok/s" for system, row in rates.items()))
        step_costs[workload] = engine.cache_stats()["speculative"]["step_costs"]
    rows = _rows(samples, systems + (tuple(TOGETHER_SYSTEMS) if runner is not None else ()))
    _print(console, rows, draft_note)
    together = {w: r.decode_tok_s / plain.decode_tok_s for w in dict.fromkeys(x.workload for x in rows)
                for r in rows if r.workload == w and r.system == "together_prompt_lookup"
                for plain in rows if plain.workload == w and plain.system == "together"}
    if together:
        console.print("rows together, prompt lookup over the same batch without it: " + ", ".join(
            f"{w} {x:.2f}x" for w, x in together.items()))
    _print_costs(console, step_costs, k)
    if json_path:
        from .plots import write_json

        write_json(json_path, {"benchmark": "spec", **choice.record(engine), "threads": torch.get_num_threads(),
                               "fast_path": {key: fast[key] for key in ("mode", "reason", "compiled_steps")},
                               "max_new_tokens": max_new_tokens, "num_speculative_tokens": k,
                               "prompt_lookup_ngram": [engine.config.prompt_lookup_min_ngram or "auto", max_ngram],
                               "draft_model": draft_note, "rows": [asdict(r) for r in rows],
                               "step_costs": step_costs, "together_lookup_over_plain": together})
        console.print(f"wrote {json_path}")
    if plot_path:
        from .plots import plot_bars

        bars = {w: {r.system: r.speedup for r in rows if r.workload == w} for w in dict.fromkeys(r.workload
                                                                                               for r in rows)}
        plot_bars(bars, f"Decode speed vs KVBoost without speculation (greedy, fast path {fast['mode']})",
                  "workload", "x decode tok/s", plot_path)
        console.print(f"wrote {plot_path}")
    return rows


def _run_alone(runner, request):
    """One request through the batching runner, alone in it (as a batching server runs it between others)."""
    handle = runner.add(request)
    while runner.has_work():
        runner.step()
    if handle.error is not None:
        raise handle.error
    return handle.result


def _run_together(runner, workload: str, system: str, refs: list[tuple[list[int], list[int] | None]],
                  max_new_tokens: int, spec: str) -> list[Sample]:
    """TOGETHER_COPIES requests of each of a workload's prompts, queued at once: the runner takes as many rows as
    it holds and admits the rest as rows leave. The decode time, from the first token to the last row's end, is
    shared evenly among the samples (so that a workload's tok/s is every row's decode tokens over that time)."""
    engine = runner.engine
    queued = [(engine.request(input_ids=ids, max_new_tokens=max_new_tokens, speculative=spec), ref)
              for _ in range(TOGETHER_COPIES) for ids, ref in refs]
    handles = [runner.add(request) for request, _ in queued]
    while runner.has_work():
        runner.step()
    end = time.perf_counter()
    for h in handles:
        if h.error is not None:
            raise h.error
    results = [h.result for h in handles]
    first = min(request.t_start + r.ttft_ms / 1e3 for (request, _), r in zip(queued, results))
    wall_s = max(end - first, 1e-6)
    return [Sample(workload, system, r.generated_tokens, wall_s / len(results), r.output_token_ids == ref,
                   r.draft_tokens, r.accepted_tokens) for r, (_, ref) in zip(results, queued)]


def _rows(samples: list[Sample], systems: tuple[str, ...] = SYSTEMS) -> list[Row]:
    rows: list[Row] = []
    groups: dict[tuple[str, str], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.workload, s.system), []).append(s)
    for workload in dict.fromkeys(s.workload for s in samples):
        # Decode tok/s over the workload: all decode tokens over all decode time (long answers weigh more).
        rates = {}
        for system in systems:
            g = groups[(workload, system)]
            rates[system] = sum(s.generated - 1 for s in g) / sum(s.decode_s for s in g)
        for system in systems:
            g = groups[(workload, system)]
            drafted = sum(s.draft_tokens for s in g)
            rows.append(Row(workload, system, len(g), rates[system], rates[system] / rates["kvboost"],
                            sum(s.accepted_tokens for s in g) / drafted if drafted else None,
                            statistics.mean(1.0 if s.identical else 0.0 for s in g), [asdict(s) for s in g]))
    return rows


def _print(console: Console, rows: list[Row], draft_note: str) -> None:
    table = Table(title="Speculative decoding, greedy: decode tok/s per workload", caption=(
        "speedup = decode tok/s / KVBoost without speculation on the same prompts; identical = output tokens "
        f"equal to KVBoost without speculation; draft = {draft_note}; acceptance = kept / proposed drafts "
        "(HF does not report it); together: each prompt queued "
        f"{TOGETHER_COPIES} times into a runner of max(4, --per-workload) rows, {TOGETHER_ROUNDS} rounds, tok/s of the "
        "batch"))
    for col in ("workload", "system", "prompts", "decode tok/s", "speedup", "acceptance", "identical"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.workload, r.system, str(r.prompts), f"{r.decode_tok_s:.1f}", f"{r.speedup:.2f}x",
                      "-" if r.acceptance is None else f"{r.acceptance:.0%}", f"{r.identical_rate:.0%}")
    console.print(table)


def _print_costs(console: Console, step_costs: dict[str, dict], k: int) -> None:
    """The verification cost the engine measured (its AdaptiveK fit: a step's time including proposing)."""
    table = Table(title="Measured step costs (the engine's own fit, after each workload)", caption=(
        f"verify n = the last token and n - 1 drafts in one forward; per token / step = verify ms / n / plain step "
        f"ms (below 1: verifying beats decoding the tokens one by one); {k + 1} = k + 1"))
    for col in ("after", "method", "plain step ms", "verify 2 ms", f"verify {k + 1} ms", "per token / step"):
        table.add_column(col, justify="right")

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    n = str(k + 1)
    for workload, methods in step_costs.items():
        for method, c in methods.items():
            ratio = c["verify_per_token_over_step"].get(n)
            verify = c["verify_ms"].get(n)
            table.add_row(workload, method, ms(c["plain_step_ms"]), ms(c["verify_ms"].get("2")), ms(verify),
                          "-" if ratio is None else f"{ratio:.2f}")
    console.print(table)


def bench_spec_command(
    model: ModelOption = None, shape: ShapeOption = None, device: DeviceOption = None, dtype: DtypeOption = None,
    max_new_tokens: int = typer.Option(64, min=2, help="Tokens generated per prompt."),
    per_workload: int = typer.Option(4, min=1, help="Prompts per workload (rag, code, extract, chat)."),
    k: int = typer.Option(8, "--num-speculative-tokens", "-k", min=1, max=15, help="Most drafts per verify."),
    draft_model: str | None = typer.Option(None, "--draft-model", help="A draft sharing the tokenizer (default: "
                                           "a tiny random one: exactness and verification cost only)."),
    json_path: str | None = typer.Option(None, "--json", help="Write results as JSON."),
    plot_path: str | None = typer.Option(None, "--plot", help="Write a PNG plot."),
    min_ngram: int | None = typer.Option(None, "--prompt-lookup-min-ngram", min=1,
                                         help="Shortest n-gram prompt lookup matches (default: the engine's)."),
    max_ngram: int = typer.Option(3, "--prompt-lookup-max-ngram", min=1, help="Longest n-gram it tries first."),
    batch_runner: bool = typer.Option(False, "--batch-runner", help="Also run each prompt as a row of the "
                                      "continuous-batching runner (a batching server's path), alone and with the "
                                      "workload's other prompts at once, without and with prompt lookup."),
    fast_path: str | None = typer.Option(None, "--fast-path", help="The engine's fast_path (auto, graphs, "
                                         "compiled, eager, off; default: the engine's, auto)."),
) -> None:
    """Decode tok/s, acceptance and identical outputs: no speculation, prompt lookup, a draft model, HF's."""
    from kvboost.model.runner import FAST_PATHS

    if fast_path is not None and fast_path not in FAST_PATHS:
        raise typer.BadParameter(f"{fast_path!r}: expected one of {', '.join(FAST_PATHS)}", param_hint="--fast-path")
    run_spec_bench(model_choice(model, shape, device, dtype), max_new_tokens, per_workload, k, draft_model,
                   json_path, plot_path, min_ngram=min_ngram, max_ngram=max_ngram, batch_runner=batch_runner,
                   fast_path=fast_path)
