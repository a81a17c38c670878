"""`kvboost demo`: warm a long system prompt, then answer questions twice each: a baseline (full prefill) and KVBoost
reusing exactly the system prompt's stored tokens (nothing resident, nothing written back), timing that reuse alone."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

if TYPE_CHECKING:
    from .engine import InferenceEngine

# Requests store nothing: only warm() does, so each question can reuse the system prompt and nothing more.
DEMO_ENGINE_OPTIONS: dict[str, Any] = {"write_back": False}
QUESTION_WIDTH = 40  # at most; narrower terminals cut it further


@dataclass(frozen=True)
class QuestionRun:
    """One question asked after the system prompt: the baseline against KVBoost reusing the system prompt."""

    question: str
    prompt_tokens: int
    cached_tokens: int  # what the KVBoost run reused: the system prompt's stored tokens
    baseline_ttft_ms: float
    kvboost_ttft_ms: float
    identical: bool  # same greedy tokens from both runs
    answer: str

    @property
    def speedup(self) -> float:
        return self.baseline_ttft_ms / self.kvboost_ttft_ms


def ask(engine: InferenceEngine, system_messages: list[dict[str, str]], question: str,
        max_new_tokens: int) -> QuestionRun:
    """Ask `question` after the system messages, baseline first, then KVBoost from the stored chunks."""
    messages = system_messages + [{"role": "user", "content": question}]
    base = engine.generate(messages=messages, max_new_tokens=max_new_tokens, mode="baseline")
    # The baseline's K/V of this very prompt is still resident: reusing it would time a repeat.
    engine.forget_workspace()
    fast = engine.generate(messages=messages, max_new_tokens=max_new_tokens)
    return QuestionRun(question, fast.prompt_tokens, fast.cached_tokens, base.ttft_ms, fast.ttft_ms,
                       base.output_token_ids == fast.output_token_ids, fast.output_text)


def run_demo(model: str | None, n_questions: int, max_new_tokens: int, weights: str = "float") -> None:
    from .cli_common import load_engine, one_line
    from .loading import is_embedded
    from .samples import load_system_prompt

    console = Console()
    system, questions = load_system_prompt()
    questions = questions[:n_questions]
    t0 = time.perf_counter()
    with console.status("loading model (first run converts the embedded GGUF once, ~20 s)"):
        engine = load_engine(model, weights=weights, **DEMO_ENGINE_OPTIONS)
    console.print(f"model loaded in {time.perf_counter() - t0:.1f} s "
                  f"({type(engine.model).__name__}, {engine.kv_dtype}, chunk {engine.config.chunk_size})")
    system_messages = [{"role": "system", "content": system}]
    with console.status("warming the system prompt"):
        warm = engine.warm(messages=system_messages)
    console.print(f"warmed {warm.tokens} system-prompt tokens into {warm.chunks_stored} chunks "
                  f"in {warm.elapsed_ms:.0f} ms")

    table = Table(title="TTFT: baseline (full prefill) vs KVBoost (only the stored system prompt reused)",
                  caption="reused: prompt tokens KVBoost took from the cache / the prompt's tokens")
    figures = (("baseline", "right", 8), ("KVBoost", "right", 8), ("speedup", "right", 7), ("reused", "right", 9),
               ("identical", "center", 9))
    # The question is cut to what the figures leave of one line (column: width + 2 padding + 1 border).
    room = console.width - sum(width + 3 for _, _, width in figures) - 4
    table.add_column("question", no_wrap=True, overflow="ellipsis", max_width=max(room, 8))
    for col, justify, width in figures:
        table.add_column(col, justify=justify, no_wrap=True, min_width=width)
    runs = []
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("answering", total=len(questions))
        for q in questions:
            run = ask(engine, system_messages, q, max_new_tokens)
            identical = "[green]yes[/]" if run.identical else "[red]NO[/]"
            table.add_row(one_line(q, QUESTION_WIDTH), f"{run.baseline_ttft_ms:.0f} ms",
                          f"{run.kvboost_ttft_ms:.0f} ms", f"{run.speedup:.1f}x",
                          f"{run.cached_tokens}/{run.prompt_tokens}", identical)
            runs.append(run)
            progress.advance(task)
    console.print(table)
    if is_embedded(model):
        # The answers often contradict the system prompt; say why before anyone reads them as KVBoost's doing.
        console.print("[dim]The embedded model has 135M parameters, so its answers are illustrative only: the point "
                      "is the TTFT and that both runs give identical outputs.[/]")
    for run in runs[:2]:
        console.print(f"[bold]Q:[/] {run.question}\n[bold]A:[/] {run.answer.strip()}\n")
    stats = engine.cache_stats()
    console.print(f"cache: {stats['tiers']}  avg lookup {stats['avg_lookup_ms']:.2f} ms")
