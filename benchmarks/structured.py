"""`kvboost bench structured`: JSON schemas x prompts, generated with and without the grammar mask.

The shipped set (data/structured/schemas.jsonl: hand-written, so outside the generated workload files; 24
schemas with nested objects, arrays, enums, bounded numbers and optional fields, two prompts each) is asked
for as a chat whose system message shows the schema; every case runs greedy twice over the same prompt: free
(the model alone) and constrained (response_format json_schema).
Reported: the share of outputs that parse and validate against the schema, decode tok/s of both runs, the mask's
own cost per token (the constrained outputs replayed through a fresh constraint: fill + apply + advance, timed
alone, so other load on the machine does not blur it), and each schema's compile time on first use and cached.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from .console import bench_console
from .model_options import (
    QUALITY_REFUSAL,
    DeviceOption,
    DtypeOption,
    ModelChoice,
    ModelOption,
    ShapeOption,
    as_choice,
    model_choice,
)
from .workloads import data_dir


@dataclass
class Case:
    schema: str
    prompt: str
    free_valid: bool
    constrained_valid: bool
    free_tokens: int
    constrained_tokens: int
    free_decode_s: float
    constrained_decode_s: float
    mask_ms_per_token: float
    constrained_finish: str
    constrained_text: str
    free_text: str


@dataclass
class Summary:
    schemas: int
    cases: int
    constrained_valid_rate: float
    constrained_ended_rate: float  # outputs that ended on their own (EOS) within the budget
    valid_when_ended_rate: float  # of those, schema-valid
    closed_rate: float  # outputs the budget closed (finish "length": its last tokens forced to finish the JSON)
    free_valid_rate: float
    free_decode_tok_s: float
    constrained_decode_tok_s: float
    decode_slowdown: float  # 1 - constrained / free tok/s (both runs; includes noise from other load)
    mask_ms_per_token: float  # the mask alone, mean over every constrained token
    mask_share_of_decode: float  # mask ms per token / free decode ms per token
    compile_ms_p50: float
    compile_ms_max: float
    cached_compile_ms_p50: float
    tokenizer_setup_ms: float  # once per engine (vocabulary preprocessing), before the first compile


def load_cases() -> list[dict[str, Any]]:
    text = (data_dir() / "structured" / "schemas.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def schema_valid(text: str, schema: dict) -> bool:
    """Whether text is JSON that follows schema (jsonschema, the bench extra)."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _messages(schema: dict, prompt: str) -> list[dict]:
    return [{"role": "system", "content": "Reply with only a JSON object that follows this JSON Schema:\n"
                                          + json.dumps(schema)},
            {"role": "user", "content": prompt}]


def _decode_s(result) -> float:
    return max(result.total_ms - result.ttft_ms, 0.0) / 1e3


def _mask_ms(engine, fmt, tokens: list[int]) -> float:
    """Mean ms per token of fill + apply + advance over the given tokens, on a fresh constraint."""
    import torch

    constraint = engine.grammars.prepare(fmt).constraint()
    logits = torch.zeros(engine.grammars.vocab_size, device=engine.device)
    eos = min(engine.eos_token_ids) if engine.eos_token_ids else None
    t0 = time.perf_counter()
    for t in tokens:
        constraint.mask(logits)
        constraint.advance(t)
    steps = len(tokens)
    if eos is not None and constraint.accepts(eos):  # the output ended on its own: its EOS was masked for too
        constraint.mask(logits)
        constraint.advance(eos)
        steps += 1
    return (time.perf_counter() - t0) * 1e3 / max(steps, 1)


def run_structured_bench(model: str | ModelChoice | None, prompts_per_schema: int, new_tokens: int,
                         json_path: str | None, plot_path: str | None, limit: int | None = None) -> Summary:
    from kvboost.decoding.grammar import json_schema_format

    from .model_options import load_engine
    from .plots import plot_bars, write_json

    choice = as_choice(model)
    console = bench_console()
    with console.status("loading model"):
        engine = load_engine(choice)
    data = load_cases()[:limit] if limit else load_cases()
    t0 = time.perf_counter()
    compiler = engine.grammars
    setup_ms = (time.perf_counter() - t0) * 1e3
    fmts = [json_schema_format(d["schema"]) for d in data]
    first, cached = [], []
    for fmt in fmts:
        t = time.perf_counter()
        compiler.compile(fmt)
        first.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        compiler.compile(fmt)
        cached.append((time.perf_counter() - t) * 1e3)
    engine.generate("Warm-up.", max_new_tokens=2)
    cases: list[Case] = []
    total = sum(min(prompts_per_schema, len(d["prompts"])) for d in data)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("structured bench", total=total)
        for d, fmt in zip(data, fmts):
            for prompt in d["prompts"][:prompts_per_schema]:
                messages = _messages(d["schema"], prompt)
                free = engine.generate(messages=messages, max_new_tokens=new_tokens)
                fixed = engine.generate(messages=messages, max_new_tokens=new_tokens, response_format={
                    "type": "json_schema", "json_schema": {"name": d["name"], "schema": d["schema"]}})
                cases.append(Case(d["name"], prompt, schema_valid(free.output_text, d["schema"]),
                                  schema_valid(fixed.output_text, d["schema"]), free.generated_tokens,
                                  fixed.generated_tokens, _decode_s(free), _decode_s(fixed),
                                  _mask_ms(engine, fmt, fixed.output_token_ids), fixed.finish_reason,
                                  fixed.output_text, free.output_text))
                progress.advance(task)
    summary = _summarize(cases, len(data), first, cached, setup_ms)
    _print(console, summary, cases)
    if json_path:
        write_json(json_path, {"benchmark": "structured", **choice.record(engine), "new_tokens": new_tokens,
                               "grammar_library": "xgrammar", "summary": asdict(summary),
                               "compile_ms_first_use": dict(zip([d["name"] for d in data], first)),
                               "cases": [asdict(c) for c in cases]})
        console.print(f"wrote {json_path}")
    if plot_path:
        plot_bars({"schema-valid": {"free": summary.free_valid_rate, "constrained": summary.constrained_valid_rate},
                   "decode tok/s (relative)": {"free": 1.0, "constrained": summary.constrained_decode_tok_s
                                               / max(summary.free_decode_tok_s, 1e-9)}},
                  f"Structured output: {summary.cases} cases over {summary.schemas} schemas", "", "rate / ratio",
                  plot_path)
        console.print(f"wrote {plot_path}")
    return summary


def _summarize(cases: list[Case], schemas: int, first: list[float], cached: list[float], setup_ms: float) -> Summary:
    n = len(cases)
    free_tps = sum(max(c.free_tokens - 1, 0) for c in cases) / max(sum(c.free_decode_s for c in cases), 1e-9)
    fixed_tps = sum(max(c.constrained_tokens - 1, 0) for c in cases) / max(
        sum(c.constrained_decode_s for c in cases), 1e-9)
    tokens = sum(c.constrained_tokens + 1 for c in cases)
    mask_ms = sum(c.mask_ms_per_token * (c.constrained_tokens + 1) for c in cases) / max(tokens, 1)
    ended = [c for c in cases if c.constrained_finish == "stop"]
    return Summary(schemas, n, sum(c.constrained_valid for c in cases) / n, len(ended) / n,
                   sum(c.constrained_valid for c in ended) / len(ended) if ended else 0.0,
                   sum(c.constrained_finish == "length" and c.constrained_valid for c in cases) / n,
                   sum(c.free_valid for c in cases) / n,
                   free_tps, fixed_tps, 1 - fixed_tps / free_tps if free_tps else 0.0, mask_ms,
                   mask_ms / (1e3 / free_tps) if free_tps else 0.0, statistics.median(first), max(first),
                   statistics.median(cached), setup_ms)


def _print(console: Console, s: Summary, cases: list[Case]) -> None:
    table = Table(title=f"Structured output: {s.cases} cases over {s.schemas} JSON schemas (greedy)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [("schema-valid, constrained", f"{s.constrained_valid_rate:.1%}"),
            ("constrained outputs that ended (EOS) in budget", f"{s.constrained_ended_rate:.1%}"),
            ("schema-valid among those", f"{s.valid_when_ended_rate:.1%}"),
            ("closed by the budget (valid, finish 'length')", f"{s.closed_rate:.1%}"),
            ("schema-valid, free (schema in the prompt only)", f"{s.free_valid_rate:.1%}"),
            ("decode tok/s, free", f"{s.free_decode_tok_s:.1f}"),
            ("decode tok/s, constrained", f"{s.constrained_decode_tok_s:.1f}"),
            ("decode slowdown (both runs)", f"{s.decode_slowdown:.1%}"),
            ("mask ms / token (alone)", f"{s.mask_ms_per_token:.3f}"),
            ("mask share of a decode step", f"{s.mask_share_of_decode:.1%}"),
            ("compile ms, first use p50 / max", f"{s.compile_ms_p50:.1f} / {s.compile_ms_max:.1f}"),
            ("compile ms, cached p50", f"{s.cached_compile_ms_p50:.3f}"),
            ("tokenizer setup ms (once per engine)", f"{s.tokenizer_setup_ms:.0f}")]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    bad = [c for c in cases if not c.constrained_valid]
    for c in bad[:5]:
        console.print(f"[yellow]invalid constrained output[/] {c.schema} ({c.constrained_finish}): "
                      f"{c.constrained_text[:120]!r}")


def bench_structured_command(
    model: ModelOption = None, shape: ShapeOption = None, device: DeviceOption = None, dtype: DtypeOption = None,
    prompts: int = typer.Option(2, min=1, help="Prompts per schema (the shipped set has 2)."),
    schemas: int | None = typer.Option(None, min=1, help="Only the first N schemas."),
    new_tokens: int = typer.Option(256, min=1, help="Token budget per output."),
    json_path: str | None = typer.Option(None, "--json", help="Write results as JSON."),
    plot_path: str | None = typer.Option(None, "--plot", help="Write a PNG plot."),
) -> None:
    """Schema-valid rate, decode tok/s and compile time of JSON-schema constrained output (needs the structured
    extra; refuses --shape: validity needs real weights)."""
    choice = model_choice(model, shape, device, dtype,
                          refuse_shape=QUALITY_REFUSAL.format(command="bench structured"))
    run_structured_bench(choice, prompts, new_tokens, json_path, plot_path, schemas)
