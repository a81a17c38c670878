"""`kvboost demo`: the main job in one screen: warm a long system prompt, then answer questions."""
from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table


def run_demo(model: str | None, n_questions: int, max_new_tokens: int) -> None:
    from .cli_common import load_engine
    from .loading import is_embedded
    from .samples import load_system_prompt

    console = Console()
    system, questions = load_system_prompt()
    questions = questions[:n_questions]
    t0 = time.perf_counter()
    with console.status("loading model (first run converts the embedded GGUF once, ~20 s)"):
        engine = load_engine(model)
    console.print(f"model loaded in {time.perf_counter() - t0:.1f} s "
                  f"({type(engine.model).__name__}, {engine.kv_dtype}, chunk {engine.config.chunk_size})")
    system_messages = [{"role": "system", "content": system}]
    with console.status("warming the system prompt"):
        warm = engine.warm(messages=system_messages)
    console.print(f"warmed {warm.tokens} system-prompt tokens into {warm.chunks_stored} chunks "
                  f"in {warm.elapsed_ms:.0f} ms")

    table = Table(title="TTFT: baseline (full prefill) vs KVBoost (system prompt reused)")
    for col, justify in (("question", "left"), ("tokens", "right"), ("baseline", "right"),
                         ("KVBoost", "right"), ("speedup", "right"), ("reuse", "right"),
                         ("identical", "center")):
        table.add_column(col, justify=justify)
    answers = []
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("answering", total=len(questions))
        for q in questions:
            messages = system_messages + [{"role": "user", "content": q}]
            base = engine.generate(messages=messages, max_new_tokens=max_new_tokens, mode="baseline")
            fast = engine.generate(messages=messages, max_new_tokens=max_new_tokens)
            same = base.output_token_ids == fast.output_token_ids
            # Cut to fit one line of an 80-column terminal beside the figures (the answers below repeat it whole).
            short = q if len(q) <= 28 else q[:27] + "…"
            table.add_row(short, str(fast.prompt_tokens), f"{base.ttft_ms:.0f} ms", f"{fast.ttft_ms:.0f} ms",
                          f"{base.ttft_ms / fast.ttft_ms:.1f}x", f"{fast.kv_reuse_ratio:.0%}",
                          "[green]yes[/]" if same else "[red]NO[/]")
            answers.append((q, fast.output_text))
            progress.advance(task)
    console.print(table)
    if is_embedded(model):
        # The answers often contradict the system prompt; say why before anyone reads them as KVBoost's doing.
        console.print("[dim]The embedded model has 135M parameters, so its answers are illustrative only: the point "
                      "is the TTFT and that both runs give identical outputs.[/]")
    for q, a in answers[:2]:
        console.print(f"[bold]Q:[/] {q}\n[bold]A:[/] {a.strip()}\n")
    stats = engine.cache_stats()
    console.print(f"cache: {stats['tiers']}  avg lookup {stats['avg_lookup_ms']:.2f} ms")
