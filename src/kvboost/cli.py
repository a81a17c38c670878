"""Command line: kvboost demo | verify | bench ... | cost | serve."""
from __future__ import annotations

from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="KVBoost: chunk-level KV-cache reuse for Hugging Face causal LMs.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print side-by-side tables, JSON and plots.")
app.add_typer(bench_app, name="bench")
eval_app = typer.Typer(no_args_is_help=True, help="Fidelity evaluations of approximate reuse.")
app.add_typer(eval_app, name="eval")

def load_engine(model: str | None, **options):
    """KVBoost.from_pretrained, with a one-line error instead of a traceback for a bad model argument."""
    from . import KVBoost

    try:
        return KVBoost.from_pretrained(model, **options)
    except (OSError, ValueError, ImportError) as exc:
        typer.echo(f"error: cannot load model {model or '(embedded)'!r}: {str(exc).splitlines()[0]}", err=True)
        raise typer.Exit(2) from None


ModelOpt = typer.Option(None, "--model", "-m", help="Local path or Hugging Face id (default: embedded SmolLM2-135M).")


@app.command()
def demo(model: Optional[str] = ModelOpt,
         questions: int = typer.Option(4, min=1, max=20, help="How many questions to ask."),
         max_new_tokens: int = typer.Option(32, min=1, help="Tokens per answer.")):
    """Warm a ~1,000-token system prompt, answer questions, compare baseline vs reused TTFT."""
    from .demo import run_demo

    run_demo(model, questions, max_new_tokens)


@app.command()
def verify(model: Optional[str] = ModelOpt,
           max_new_tokens: int = typer.Option(32, min=1),
           prompt: Optional[list[str]] = typer.Option(None, "--prompt", "-p", help="Prompt(s) to check (repeatable).")):
    """Check that cached generation is token-identical to plain generation on this model."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    with console.status("loading model"):
        engine = load_engine(model)
    with console.status("comparing baseline and cached generation"):
        report = engine.verify_correctness(prompt or None, max_new_tokens)
    table = Table(title=f"verify_correctness ({max_new_tokens} greedy tokens)")
    for col in ("prompt", "reused chunks", "identical", "max logit diff", "first-token KL"):
        table.add_column(col)
    for c in report.checks:
        table.add_row(c.prompt_preview, str(c.reused_chunks), "yes" if c.identical else "NO",
                      f"{c.max_logit_diff:.2e}", f"{c.first_token_kl:.2e}")
    console.print(table)
    console.print(report.summary())
    raise typer.Exit(0 if report else 1)


@bench_app.command("prefix")
def bench_prefix(model: Optional[str] = ModelOpt,
                 lengths: str = typer.Option("1000,2000,4000,7000", help="Cached prefix lengths in tokens."),
                 repeats: int = typer.Option(5, min=1, help="Timed repeats per length (median reported)."),
                 json_path: Optional[str] = typer.Option(None, "--json", help="Write results as JSON."),
                 plot_path: Optional[str] = typer.Option(None, "--plot", help="Write a PNG plot.")):
    """TTFT of baseline, KVBoost and the floor (suffix prefill over a cache in place), side by side."""
    from .bench.prefix import run_prefix_bench

    run_prefix_bench(model, [int(x) for x in lengths.split(",") if x.strip()], repeats, json_path, plot_path)


@bench_app.command("quant")
def bench_quant(model: Optional[str] = ModelOpt,
                prompts: int = typer.Option(109, min=1, help="Chat prompts (system prompt warmed, first user turn)."),
                new_tokens: int = typer.Option(16, min=1, help="Greedy tokens compared per prompt."),
                json_path: Optional[str] = typer.Option(None, "--json", help="Write results as JSON."),
                plot_path: Optional[str] = typer.Option(None, "--plot", help="Write a PNG plot.")):
    """Bytes per cached token and fidelity of int8 / int4 KV storage against 16-bit."""
    from .bench.quant import run_quant_bench

    run_quant_bench(model, prompts, new_tokens, json_path, plot_path)


@bench_app.command("multiturn")
def bench_multiturn(model: Optional[str] = ModelOpt,
                    conversations: int = typer.Option(8, min=1, help="Conversations to replay (of 64 shipped)."),
                    turns: int = typer.Option(8, min=1, help="At most this many user turns per conversation."),
                    new_tokens: int = typer.Option(128, min=1, help="Greedy tokens per reply (at most; EOS ends it)."),
                    json_path: Optional[str] = typer.Option(None, "--json", help="Write results as JSON."),
                    plot_path: Optional[str] = typer.Option(None, "--plot", help="Write a PNG plot."),
                    peer_python: Optional[str] = typer.Option(None, "--peer-python",
                                                              help="Python of a virtualenv with another kvboost."),
                    workload: str = typer.Option("chat", help="chat: the 64 shipped conversations (80-370-token "
                                                              "system prompts); support: the ~1,000-token manual "
                                                              "of the system-prompt workload, its questions as turns.")):
    """Replay chats turn by turn: plain transformers, the manual prefix-cache recipe, KVBoost (and a peer)."""
    from .bench.multiturn import WORKLOADS, run_multiturn_bench

    if workload not in WORKLOADS:
        raise typer.BadParameter(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}",
                                 param_hint="--workload")
    run_multiturn_bench(model, conversations, turns, new_tokens, json_path, plot_path, peer_python, workload)


def _register_modules() -> None:
    # Defined beside the code they drive; registered here so `kvboost --help` lists them all.
    from .bench.batch import bench_batch_command
    from .bench.cost import cost_command
    from .bench.rag import eval_rag_command
    from .bench.serve import bench_serve_command
    from .server.__main__ import serve_command

    app.command("serve", help="OpenAI-compatible server (also installed as kvboost-server).")(serve_command)
    app.command("cost", help="Prefill GPU time and money saved by reuse (the product site's calculator).")(
        cost_command)
    bench_app.command("serve", help="Requests/s and TTFT under concurrent clients, reuse on vs off.")(
        bench_serve_command)
    bench_app.command("batch", help="Batched decode of rows sharing a prefix: shared-prefix attention on vs off.")(
        bench_batch_command)
    rag_help = "Multi-document QA: full prefill vs none / selective / cacheblend reuse (TTFT and fidelity)."
    eval_app.command("rag", help=rag_help)(eval_rag_command)
    bench_app.command("rag", help=rag_help)(eval_rag_command)


_register_modules()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
