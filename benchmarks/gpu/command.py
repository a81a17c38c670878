"""`kvboost bench gpu`: fidelity vs HF generate, chat-turn TTFT, prefix TTFT vs the floor, decode tokens/s and
attention kernels, side by side in one process on one model, with a live table, JSON and a plot.

Default: random weights of the Qwen2.5-3B shape in bf16 on CUDA (no hub access), or the tiny shape on CPU.
The run is budgeted (--time-limit, default 510 s, model build included): each section gets a share of the
time left, or the seconds --budgets gives it, and stops between measurements when it is spent, saying so in
the JSON; one measurement can overrun, so the default ends under 10 minutes on one H100. The JSON is rewritten
after every row (a chat turn, a prefix length, a decode system, a fidelity case), so a run killed at a time
limit still leaves everything it measured.
"""
from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Annotated, Any

import typer

from ..console import bench_console
from ..model_options import DeviceOption, DtypeOption, ModelChoice, ModelOption, ShapeOption, load_engine, model_choice
from .settings import RUN_ORDER, SECTIONS, SHARES, GpuBenchSettings
from .timing import Budget

# The targets (H100, qwen2.5-3b shape, bf16); recorded beside what this run measured. Fidelity's are
# on its own small random models, in counts of questions whose greedy tokens equal HF generate's.
TARGETS = {"chat_kvboost_p50_ms_from_turn2": 12.0, "chat_p99_over_p50": 2.0, "decode_batch1_tok_s": 250.0,
           "prefix_30k_over_floor": 1.1, "fidelity_fp32": "KVBoost identical to HF generate on every question",
           "fidelity_bf16": "KVBoost identical on at least as many questions as HF's manual prefix recipe"}


def _warm_up(engine) -> None:
    """Untimed: CUDA context, cuBLAS handles and thread pools, shared by every system (no shape of the bench)."""
    import torch

    with torch.inference_mode():
        engine.model(input_ids=torch.ones(1, 8, dtype=torch.long, device=engine.device))
    engine.generate("Hello", max_new_tokens=2)
    engine.clear_cache()


def _error(exc: BaseException) -> dict:
    return {"status": "error", "reason": f"{type(exc).__name__}: {exc}"[:500],
            "traceback": traceback.format_exc(limit=6)[-3000:]}


def measured_vs_targets(report: dict) -> dict[str, Any]:
    sections = report["sections"]
    out: dict[str, Any] = {}
    chat = sections.get("chat", {})
    if chat.get("from_turn2"):
        p50, p99 = chat["from_turn2"]["kvboost_p50_ms"], chat["from_turn2"]["kvboost_p99_ms"]
        out["chat_kvboost_p50_ms_from_turn2"] = p50
        out["chat_p99_over_p50"] = p99 / p50 if p50 else None
    for row in sections.get("decode", {}).get("rows", []):
        if row["system"] == "kvboost" and row["batch"] == 1 and row.get("status") == "ok":
            out["decode_batch1_tok_s"] = row["decode_tok_s"]
    rows = sections.get("prefix", {}).get("rows", [])
    if rows:
        longest = max(rows, key=lambda r: r["prefix_tokens"])
        out["prefix_longest_tokens"] = longest["prefix_tokens"]
        out["prefix_longest_over_floor"] = longest["kvboost_over_floor"]
    out.update(fidelity_measured(sections.get("fidelity", {})))
    return out


def fidelity_measured(section: dict) -> dict[str, Any]:
    """Identical questions / questions per dtype and system, summed over the models (fidelity_bf16_kvboost:
    "22/24" and the like), and whether each dtype met its target."""
    out: dict[str, Any] = {}
    for dtype, t in section.get("totals", {}).items():
        short = {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)
        for system in ("kvboost", "recipe"):
            out[f"fidelity_{short}_{system}"] = f"{t[f'{system}_identical']}/{t['questions']}"
        if short == "fp32":
            out["fidelity_fp32_met"] = t["questions"] > 0 and t["kvboost_identical"] == t["questions"]
        elif short == "bf16":
            out["fidelity_bf16_met"] = t["questions"] > 0 and t["kvboost_identical"] >= t["recipe_identical"]
        for system, steps in t.get("fp32_steps", {}).items():  # per step, teacher-forced against fp32
            out[f"fidelity_{short}_{system}_fp32_argmax"] = f"{steps['fp32_argmax']}/{steps['steps']}"
            if "duels" in steps:
                d = steps["duels"]
                out[f"fidelity_{short}_{system}_duels"] = f"{d['won']}-{d['lost']} ({d['near_tie']} near-tie)"
    return out


def run_gpu_bench(choice: ModelChoice, settings: GpuBenchSettings, json_path: str | None = None,
                  plot_path: str | None = None) -> dict:
    from rich.live import Live
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ..plots import machine_info
    from .chat import run_chat
    from .decode import run_decode
    from .fidelity import ARCHS, DTYPES, run_fidelity
    from .kernels import run_kernels
    from .prefix import run_prefix
    from .view import LiveView, report_view, targets_line

    started = time.monotonic()
    console = bench_console()
    with console.status(f"building {choice.label}"):
        engine = load_engine(choice)
        _warm_up(engine)
    report: dict[str, Any] = {"benchmark": "gpu", **choice.record(engine), "settings": settings.record(),
                              "load_s": time.monotonic() - started, "complete": False, "sections": {},
                              "targets": TARGETS, "machine": machine_info()}
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TimeElapsedColumn(), console=console)
    fidelity_models = len(ARCHS) + (1 if settings.fidelity_bench_questions else 0)
    totals = {"fidelity": fidelity_models * len(DTYPES), "chat": settings.conversations * settings.turns,
              "prefix": len(settings.prefix_lengths),
              "kernels": 1, "decode": (3 if settings.compile else 4) * len(settings.batch_sizes)}
    tasks = {name: progress.add_task(name, total=totals[name], start=False) for name in RUN_ORDER
             if name in settings.sections}

    def save() -> None:
        if json_path:
            from ..plots import write_json

            write_json(json_path, report)

    def updater(name: str) -> Callable[[dict], None]:
        def update(section: dict) -> None:  # after every row: a run killed at a time limit keeps what it measured
            report["sections"][name] = section
            progress.advance(tasks[name])
            save()
        return update

    label = choice.shape or "bench"
    runners = {"fidelity": lambda b: run_fidelity(engine, settings, b, updater("fidelity"), bench_label=label),
               "chat": lambda b: run_chat(engine, settings, b, updater("chat")),
               "prefix": lambda b: run_prefix(engine, settings, b, updater("prefix")),
               "kernels": lambda b: run_kernels(engine, settings, b),
               "decode": lambda b: run_decode(engine, settings, b, updater("decode"))}
    with Live(LiveView(report, progress), console=console, refresh_per_second=4, transient=True):
        todo = [name for name in RUN_ORDER if name in settings.sections]
        for i, name in enumerate(todo):
            budget = Budget(section_seconds(settings, todo[i:], settings.time_limit_s - (time.monotonic() - started)))
            progress.start_task(tasks[name])
            t0 = time.monotonic()
            try:
                section = runners[name](budget)
            except Exception as exc:  # one section failing must not cost the others their results
                section = _error(exc) | {"partial": report["sections"].get(name)}
            section["budget_s"], section["wall_s"] = budget.seconds, time.monotonic() - t0
            report["sections"][name] = section
            progress.update(tasks[name], completed=totals[name])
            save()
    report["complete"], report["wall_s"] = True, time.monotonic() - started
    report["measured"] = measured_vs_targets(report)
    console.print(report_view(report))
    console.print(targets_line(report))
    save()
    if json_path:
        console.print(f"wrote {json_path}")
    if plot_path:
        from .plot import plot_gpu_report

        plot_gpu_report(report, plot_path)
        console.print(f"wrote {plot_path}")
    console.print(f"total {report['wall_s']:.0f} s (model build {report['load_s']:.0f} s)")
    return report


def section_seconds(settings: GpuBenchSettings, todo: list[str], left: float) -> float:
    """Seconds for todo[0] with `left` seconds of the run left: its --budgets entry (capped by what is left), else
    its share of what is left once the explicit budgets of the later sections are set aside."""
    left = max(0.0, left)
    name = todo[0]
    if name in settings.budgets:
        return min(settings.budgets[name], left)
    reserved = sum(settings.budgets.get(n, 0.0) for n in todo[1:])
    shared = [n for n in todo if n not in settings.budgets]
    return max(0.0, left - reserved) * SHARES[name] / sum(SHARES[n] for n in shared)


def _numbers(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=option) from None
    if not values or min(values) < 1:
        raise typer.BadParameter(f"expected positive integers, got {text!r}", param_hint=option)
    return values


def _budgets(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        name, _, seconds = item.partition("=")
        try:
            out[name.strip()] = float(seconds)
        except ValueError:
            raise typer.BadParameter(f"expected section=seconds, got {item!r}", param_hint="--budgets") from None
        if name.strip() not in SECTIONS or out[name.strip()] < 0:
            raise typer.BadParameter(f"expected section=seconds with a section of {', '.join(SECTIONS)}, got "
                                     f"{item!r}", param_hint="--budgets")
    return out


def _default_choice(model: str | None, shape: str | None, device: str | None) -> tuple[str | None, str]:
    """(shape, device) when not given: the Qwen2.5-3B shape on CUDA when there is one, the tiny shape on CPU."""
    import torch

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if model is None and shape is None:
        shape = "qwen2.5-3b" if dev.startswith("cuda") else "tiny"
    return shape, dev


def bench_gpu_command(
    model: ModelOption = None, shape: ShapeOption = None, device: DeviceOption = None, dtype: DtypeOption = None,
    quick: Annotated[bool, typer.Option("--quick", help="Smoke run: one conversation, prefixes up to 4k, 8 decode "
                                                        "tokens, 2 fidelity questions over a 160-token prefix, "
                                                        "no compile (seconds on CPU with --shape tiny).")]
    = False,
    max_prefix: Annotated[int, typer.Option("--max-prefix", min=1, help="Longest prefix of the 1k/4k/16k/30k "
                                                                         "sweep (also capped by the context).")]
    = 30000,
    sections: Annotated[str, typer.Option("--sections", help="Comma-separated subset of fidelity, chat, prefix, "
                                                             "decode, kernels.")] = ",".join(SECTIONS),
    compile_: Annotated[bool | None, typer.Option("--compile/--no-compile", help="HF static cache + torch.compile "
                                                  "baseline (default: on CUDA, not with --quick).")] = None,
    time_limit: Annotated[float, typer.Option("--time-limit", min=1.0, help="Seconds for the whole run, model "
                                                                            "build included.")] = 510.0,
    budgets: Annotated[str, typer.Option("--budgets", help="Seconds per section instead of its share of the time "
                                                           "left, e.g. fidelity=130,decode=120 (scripts/gpu_check.sh)."
                                         )] = "",
    prefix_lengths: Annotated[str | None, typer.Option("--prefix-lengths", help="Comma-separated prefix lengths "
                                                                                "instead of 1k/4k/16k/30k.")] = None,
    batch_sizes: Annotated[str | None, typer.Option("--batch-sizes", help="Comma-separated decode batch sizes "
                                                                          "instead of 1,16.")] = None,
    json_path: Annotated[str | None, typer.Option("--json", help="Write the results as JSON.")] = None,
    plot_path: Annotated[str | None, typer.Option("--plot", help="Write a PNG with one panel per section.")] = None,
) -> None:
    """Fidelity vs HF generate, chat-turn TTFT, prefix TTFT vs the floor, decode tok/s vs HF (eager,
    static+compiled), attention kernels."""
    shape, device = _default_choice(model, shape, device)
    choice = model_choice(model, shape, device, dtype)
    chosen = tuple(s.strip() for s in sections.split(",") if s.strip())
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown or not chosen:
        raise typer.BadParameter(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}",
                                 param_hint="--sections")
    import torch

    settings = GpuBenchSettings.make(
        quick=quick, device_type=torch.device(device).type, max_prefix=max_prefix, sections=chosen,
        compile_flag=compile_, time_limit_s=time_limit, budgets=_budgets(budgets),
        prefix_lengths=_numbers(prefix_lengths, "--prefix-lengths") if prefix_lengths else None,
        batch_sizes=tuple(_numbers(batch_sizes, "--batch-sizes")) if batch_sizes else None)
    report = run_gpu_bench(choice, settings, json_path, plot_path)
    failed = [name for name, s in report["sections"].items() if s.get("status") == "error"]
    if failed:
        typer.echo(f"sections that failed: {', '.join(failed)} (see the JSON for the traceback)", err=True)
    raise typer.Exit(1 if failed else 0)
