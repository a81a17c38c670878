"""Command line: kvboost demo | verify | cost | serve | bench ... | eval ...

A plain install runs every command except `serve` / `bench serve` (the server extra) and --plot (the bench
extra); those check for their extra first and exit with a one-line install hint. `bench` and `eval` are the
repository's benchmarks, registered when a source checkout holds them (see benchmarks_finder).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

from . import __version__
from .benchmarks_finder import NEEDS_A_CHECKOUT, find_benchmark_commands
from .cli_common import MODEL_HELP, load_engine, one_line
from .cli_help import HelpTyper
from .extras import missing_extras, require

app = HelpTyper(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                help="KVBoost: chunk-level KV-cache reuse for Hugging Face causal LMs.")
BENCH_HELP = "Benchmarks that print side-by-side tables, JSON and plots."
EVAL_HELP = "Fidelity evaluations of approximate reuse."
# A stand-in command takes any arguments, so `kvboost serve --port 1` gets its hint, not a usage error.
ANY_ARGUMENTS = {"allow_extra_args": True, "ignore_unknown_options": True}


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"kvboost {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    pass


ModelOpt = typer.Option(None, "--model", "-m", help=MODEL_HELP)


@app.command()
def demo(model: str | None = ModelOpt,
         questions: int = typer.Option(4, min=1, max=20, help="How many questions to ask."),
         max_new_tokens: int = typer.Option(32, min=1, help="Tokens per answer."),
         weights: str = typer.Option("float", help="float, or int4: the Linear layers in INT4 (CPU; the embedded "
                                                    "model's Q4_1 blocks as stored).")):
    """Warm a ~1,000-token system prompt, answer questions, compare baseline vs reused TTFT."""
    from .demo import run_demo

    run_demo(model, questions, max_new_tokens, weights)


@app.command()
def verify(model: str | None = ModelOpt,
           max_new_tokens: int = typer.Option(32, min=1, help="Greedy tokens compared per prompt."),
           prompt: list[str] | None = typer.Option(None, "--prompt", "-p", help="Prompt(s) to check (repeatable).")):
    """Check that cached generation is token-identical to plain generation on this model."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    with console.status("loading model"):
        engine = load_engine(model)
    with console.status("comparing baseline and cached generation"):
        report = engine.verify_correctness(prompt or None, max_new_tokens)
    table = Table(title=f"verify_correctness ({max_new_tokens} greedy tokens)")
    for col in ("#", "reused chunks", "identical", "max logit diff", "first-token KL"):
        table.add_column(col, justify="right" if col == "#" else "left")
    for i, c in enumerate(report.checks, 1):
        table.add_row(str(i), str(c.reused_chunks), "yes" if c.identical else "NO", f"{c.max_logit_diff:.2e}",
                      f"{c.first_token_kl:.2e}")
    console.print(table)
    # Each prompt on a line of its own below, cut to the terminal's width: in a table column beside the figures
    # it would wrap into fragments over many lines. The preview is the prompt's end (where prompts differ).
    console.print("[dim]prompts, by their last characters:[/]")
    for i, c in enumerate(report.checks, 1):
        label = f"{i:>3}  "
        console.print(label + one_line(c.prompt_preview, console.width - len(label)), markup=False, highlight=False,
                      no_wrap=True)
    console.print(report.summary())
    raise typer.Exit(0 if report else 1)


def _serve_command() -> Callable[..., Any]:
    """The server's command when its extra is installed; else a stand-in that prints the install hint (importing
    the server package loads fastapi, so without the extra the real command cannot even be registered)."""
    if not missing_extras("server"):
        from .server.__main__ import serve_command

        return serve_command

    def serve(ctx: typer.Context) -> None:
        require("kvboost serve", "server")

    return serve


def _benchmarks_need_a_checkout(ctx: typer.Context) -> None:
    typer.echo(NEEDS_A_CHECKOUT, err=True)
    raise typer.Exit(2)


def _register_commands() -> None:
    from .cost import cost_command

    serve = _serve_command()
    app.command("serve", help="OpenAI-compatible server (also installed as kvboost-server; needs the server "
                              "extra).", context_settings=ANY_ARGUMENTS if serve.__name__ == "serve" else None)(serve)
    app.command("cost", help="Prefill GPU time and money saved by reuse (the product site's calculator).")(cost_command)
    benchmarks = find_benchmark_commands()
    if benchmarks is None:
        # Even `kvboost bench --help` says where the benchmarks are: there is nothing else to show.
        for name, help_text in (("bench", BENCH_HELP), ("eval", EVAL_HELP)):
            app.command(name, help=f"{help_text} (from a source checkout)", context_settings=ANY_ARGUMENTS,
                        add_help_option=False)(_benchmarks_need_a_checkout)
        return
    bench_app = HelpTyper(no_args_is_help=True, help=BENCH_HELP)
    eval_app = HelpTyper(no_args_is_help=True, help=EVAL_HELP)
    app.add_typer(bench_app, name="bench")
    app.add_typer(eval_app, name="eval")
    benchmarks.register(bench_app, eval_app)


_register_commands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
