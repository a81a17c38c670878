"""`kvboost bench batch`: batched decode with shared-prefix attention on versus off, in one run.

N rows share a P-token system prompt (stored beforehand, as a server that has been up would have it)
and ask different questions. With shared-prefix attention off every row holds its own copy of the
prefix K/V and every decode step reads all N copies; on, the prefix K/V is held once and read once per
step. The same rows run in both modes on one engine; the table shows decode tokens/s, time per decode
step, the K/V bytes live during decode, and whether the greedy outputs are identical.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Annotated

import typer

from .console import bench_console
from .model_options import DeviceOption, DtypeOption, ModelChoice, ModelOption, ShapeOption, as_choice, model_choice


@dataclass
class BatchRun:
    mode: str  # "shared prefix" or "per-row copies"
    rows: int
    prefix_tokens: int
    shared_prefix_tokens: int  # what the runner actually shared (0 when off)
    admit_ms: float  # first step: prefill of every row (and the first decode)
    decode_steps: int
    decode_tokens: int
    decode_tokens_per_s: float
    ms_per_step_median: float
    kv_bytes_live: int  # shared prefix once + every row's own K/V, at the first decode step
    kv_bytes_allocated: int
    outputs: list[list[int]]


def _rows(engine, n_rows: int, prefix: int) -> tuple[list[int], list[list[int]]]:
    from .workloads import load_system_prompt

    system, questions = load_system_prompt()
    tok = engine.tokenizer
    system_ids = tok(system, add_special_tokens=False)["input_ids"]
    if not system_ids:
        raise ValueError("the shipped system prompt tokenizes to nothing")
    while len(system_ids) < prefix:
        system_ids = system_ids + system_ids
    system_ids = [int(t) for t in system_ids[:prefix]]
    rows = []
    for i in range(n_rows):
        q = questions[i % len(questions)]["question"] if questions else "What is this about?"
        suffix = f"\n\nQuestion {i + 1}: {q}\nAnswer:"
        rows.append(system_ids + [int(t) for t in tok(suffix, add_special_tokens=False)["input_ids"]])
    return system_ids, rows


def _run(engine, rows: list[list[int]], new_tokens: int, shared: bool, label: str, prefix: int) -> BatchRun:
    from kvboost.sampling import SamplingParams
    from kvboost.scheduler import Scheduler

    runner = Scheduler(engine, max_batch_size=len(rows), shared_prefix_attention=shared)
    params = SamplingParams(max_new_tokens=new_tokens)
    handles = [runner.add(ids, params, "") for ids in rows]
    t0 = time.perf_counter()
    runner.step()
    admit_ms = (time.perf_counter() - t0) * 1e3
    live = runner.kv_bytes()
    shared_tokens = runner.prefix.length if runner.prefix is not None else 0
    step_ms: list[float] = []
    tokens = 0
    while runner.has_work():
        active = runner.active_count()
        t = time.perf_counter()
        runner.step()
        step_ms.append((time.perf_counter() - t) * 1e3)
        tokens += active
    for h in handles:
        if h.error is not None:
            raise h.error
    total_s = sum(step_ms) / 1e3
    return BatchRun(label, len(rows), prefix, shared_tokens, admit_ms, len(step_ms), tokens,
                    tokens / total_s if total_s > 0 else 0.0, statistics.median(step_ms) if step_ms else 0.0,
                    live["shared"] + live["rows"], live["allocated"],
                    [list(h.result.output_token_ids) for h in handles])


def run_batch_bench(model: str | ModelChoice | None, n_rows: int, prefix: int, new_tokens: int,
                    json_path: str | None = None, plot_path: str | None = None) -> dict:
    from .model_options import load_engine

    choice = as_choice(model)
    console = bench_console()
    with console.status("loading model"):
        engine = load_engine(choice)
    system_ids, rows = _rows(engine, n_rows, prefix)
    with console.status("storing the shared prefix"):
        engine.warm_ids(system_ids, None)
    with console.status("warm-up"):
        for shared in (False, True):
            _run(engine, rows[:2], 2, shared, "warm-up", prefix)
    runs = []
    for shared, label in ((False, "per-row copies"), (True, "shared prefix")):
        with console.status(f"decoding {n_rows} rows: {label}"):
            runs.append(_run(engine, rows, new_tokens, shared, label, prefix))
    identical = runs[0].outputs == runs[1].outputs
    report = {"benchmark": "batch", **choice.record(engine), "rows": n_rows,
              "prefix_tokens": prefix, "new_tokens": new_tokens, "identical_outputs": identical,
              "runs": [{k: v for k, v in vars(r).items() if k != "outputs"} for r in runs]}
    _print(console, runs, identical)
    if json_path:
        from .plots import write_json

        write_json(json_path, report)
        console.print(f"wrote {json_path}")
    if plot_path:
        plot_report(report, plot_path)
        console.print(f"wrote {plot_path}")
    return report


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _print(console, runs: list[BatchRun], identical: bool) -> None:
    from rich.table import Table

    r0 = runs[0]
    table = Table(title=f"batched decode: {r0.rows} rows sharing a {r0.prefix_tokens}-token prefix")
    for col in ("mode", "shared tok", "decode tok/s", "ms/step", "KV live", "KV alloc", "admit ms", "same out"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for r in runs:
        table.add_row(r.mode, str(r.shared_prefix_tokens), f"{r.decode_tokens_per_s:,.1f}",
                      f"{r.ms_per_step_median:,.2f}", _mb(r.kv_bytes_live), _mb(r.kv_bytes_allocated),
                      f"{r.admit_ms:,.0f}", "yes" if identical else "NO")
    console.print(table)
    console.print("ms/step: median decode step; KV live: shared prefix once + each row's own K/V at the first "
                  "decode step; KV alloc: workspace buffers, every row's columns up to the capacity (with a shared "
                  "prefix they start at its end), grown in steps of 256 positions")
    if runs[0].decode_tokens_per_s > 0:
        console.print(f"decode speed-up with shared prefix: "
                      f"{runs[1].decode_tokens_per_s / runs[0].decode_tokens_per_s:.2f}x")


def plot_report(report: dict, path: str) -> None:
    """Grouped bars, each metric relative to per-row copies (matplotlib imported here only)."""
    from .plots import plot_bars

    off, on = report["runs"]
    metrics = (("decode tok/s", "decode_tokens_per_s"), ("ms/step", "ms_per_step_median"),
               ("KV live", "kv_bytes_live"), ("KV allocated", "kv_bytes_allocated"))
    bars = {label: {r["mode"]: (r[key] / off[key] if off[key] else float("nan")) for r in (off, on)}
            for label, key in metrics}
    plot_bars(bars, f"Batched decode: {report['rows']} rows sharing a {report['prefix_tokens']}-token prefix",
              "", "relative to per-row copies", path)


def bench_batch_command(
    model: ModelOption = None, shape: ShapeOption = None, device: DeviceOption = None, dtype: DtypeOption = None,
    rows: Annotated[int, typer.Option("--rows", min=1, help="Rows decoded together.")] = 16,
    prefix: Annotated[int, typer.Option("--prefix", min=1, help="Shared prefix length in tokens.")] = 1000,
    new_tokens: Annotated[int, typer.Option("--new-tokens", min=1, help="Greedy tokens per row.")] = 32,
    json_path: Annotated[str | None, typer.Option("--json", help="Write the results as JSON.")] = None,
    plot_path: Annotated[str | None, typer.Option("--plot", help="Write a PNG: decode speed and K/V bytes, "
                                                                 "shared prefix vs per-row copies.")] = None,
) -> None:
    """Decode tokens/s of rows sharing a prefix: shared-prefix attention on vs off (per-row copies)."""
    report = run_batch_bench(model_choice(model, shape, device, dtype), rows, prefix, new_tokens, json_path, plot_path)
    raise typer.Exit(0 if report["identical_outputs"] else 1)
