"""Command line: kvboost demo | verify | bench ... | cost | serve.

A plain `pip install kvboost` runs every command except `serve` / `bench serve` (the server extra) and
--plot (the bench extra); those check for their extra first and exit with a one-line install hint.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import typer

from . import __version__
from .cli_common import load_engine
from .extras import missing_extras, require

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="KVBoost: chunk-level KV-cache reuse for Hugging Face causal LMs.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print side-by-side tables, JSON and plots.")
app.add_typer(bench_app, name="bench")
eval_app = typer.Typer(no_args_is_help=True, help="Fidelity evaluations of approximate reuse.")
app.add_typer(eval_app, name="eval")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"kvboost {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    pass


ModelOpt = typer.Option(None, "--model", "-m", help="Local path or Hugging Face id (default: embedded SmolLM2-135M).")


@app.command()
def demo(model: str | None = ModelOpt,
         questions: int = typer.Option(4, min=1, max=20, help="How many questions to ask."),
         max_new_tokens: int = typer.Option(32, min=1, help="Tokens per answer.")):
    """Warm a ~1,000-token system prompt, answer questions, compare baseline vs reused TTFT."""
    from .demo import run_demo

    run_demo(model, questions, max_new_tokens)


@app.command()
def verify(model: str | None = ModelOpt,
           max_new_tokens: int = typer.Option(32, min=1),
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
    for col in ("prompt", "reused chunks", "identical", "max logit diff", "first-token KL"):
        table.add_column(col)
    for c in report.checks:
        table.add_row(c.prompt_preview, str(c.reused_chunks), "yes" if c.identical else "NO",
                      f"{c.max_logit_diff:.2e}", f"{c.first_token_kl:.2e}")
    console.print(table)
    console.print(report.summary())
    raise typer.Exit(0 if report else 1)


def _check_plot_extra(command: str, plot_path: str | None) -> None:
    # Checked before the benchmark runs: a missing matplotlib must not cost a long run its results.
    if plot_path:
        require(f"{command} --plot", "bench")


def _plot_needs_bench_extra(command: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a bench command defined elsewhere, with a plot_path parameter) checking for matplotlib first."""
    @functools.wraps(fn)  # typer reads the options from the wrapped signature
    def checked(*args: Any, **kwargs: Any) -> Any:
        _check_plot_extra(command, kwargs.get("plot_path"))
        return fn(*args, **kwargs)

    return checked


def _needs_extras(command: str, fn: Callable[..., Any], *extras: str, modules: tuple[str, ...] = ()
                  ) -> Callable[..., Any]:
    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        require(command, *extras, modules=modules)
        return fn(*args, **kwargs)

    return checked


def _serve_command() -> Callable[..., Any]:
    """The server's command when its extra is installed; else a stand-in that prints the install hint.

    Importing the server package loads fastapi, so without the extra the real command cannot even be
    registered; the stand-in takes any arguments so `kvboost serve --port 1` gets the hint, not a usage error.
    """
    if not missing_extras("server"):
        from .server.__main__ import serve_command

        return serve_command

    def serve(ctx: typer.Context) -> None:
        require("kvboost serve", "server")

    return serve


def _register_modules() -> None:
    # Defined beside the code they drive; registered here so `kvboost --help` lists them all.
    from .bench.batch import bench_batch_command
    from .bench.rag import eval_rag_command
    from .bench.serve import bench_serve_command
    from .cost import cost_command

    loose = {"allow_extra_args": True, "ignore_unknown_options": True}
    serve = _serve_command()
    app.command("serve", help="OpenAI-compatible server (also installed as kvboost-server; needs the server "
                              "extra).", context_settings=loose if serve.__name__ == "serve" else None)(serve)
    app.command("cost", help="Prefill GPU time and money saved by reuse (the product site's calculator).")(
        cost_command)
    bench_serve = _needs_extras("kvboost bench serve", bench_serve_command, "server", modules=("openai",))
    bench_app.command("serve", help="Requests/s and TTFT under concurrent clients, reuse on vs off (needs the "
                                    "server extra and openai).")(
        _plot_needs_bench_extra("kvboost bench serve", bench_serve))
    bench_app.command("batch", help="Batched decode of rows sharing a prefix: shared-prefix attention on vs off.")(
        _plot_needs_bench_extra("kvboost bench batch", bench_batch_command))
    rag_help = "Multi-document QA: full prefill vs none / selective / cacheblend reuse (TTFT and fidelity)."
    eval_app.command("rag", help=rag_help)(_plot_needs_bench_extra("kvboost eval rag", eval_rag_command))
    bench_app.command("rag", help=rag_help)(_plot_needs_bench_extra("kvboost bench rag", eval_rag_command))
    # Each takes --model/--shape/--device/--dtype (cli_common).
    from .bench.decode import bench_decode_command
    from .bench.gpu import bench_gpu_command
    from .bench.longctx import bench_longctx_command
    from .bench.multiturn import bench_multiturn_command
    from .bench.prefix import bench_prefix_command
    from .bench.quant import bench_quant_command
    from .bench.spec import bench_spec_command
    from .bench.structured import bench_structured_command

    bench_app.command("structured", help="JSON-schema constrained output: schema-valid rate, decode tok/s with and "
                                         "without the mask, compile ms (needs the structured extra).")(
        _plot_needs_bench_extra("kvboost bench structured", _needs_extras(
            "kvboost bench structured", bench_structured_command, "structured", modules=("jsonschema",))))

    for name, command in (("prefix", bench_prefix_command), ("quant", bench_quant_command),
                          ("multiturn", bench_multiturn_command), ("decode", bench_decode_command),
                          ("gpu", bench_gpu_command), ("spec", bench_spec_command),
                          ("longctx", bench_longctx_command)):
        bench_app.command(name)(_plot_needs_bench_extra(f"kvboost bench {name}", command))


_register_modules()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
