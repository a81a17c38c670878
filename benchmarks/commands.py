"""The `kvboost bench` and `kvboost eval` commands, registered on the CLI's sub-apps.

`kvboost.cli` calls `register(bench_app, eval_app)` when it finds this package (a source checkout), so
`kvboost --help` lists every command. Each command is defined beside the code it drives; here each one is
wrapped to check for the optional extras it needs before it runs.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import typer

from kvboost.extras import require


def _check_plot_extra(command: str, plot_path: str | None) -> None:
    # Checked before the benchmark runs: a missing matplotlib must not cost a long run its results.
    if plot_path:
        require(f"{command} --plot", "bench")


def _plot_needs_bench_extra(command: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a bench command with a plot_path parameter) checking for matplotlib first."""
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


def register(bench_app: typer.Typer, eval_app: typer.Typer) -> None:
    """Add every benchmark to `bench_app` (`kvboost bench ...`) and the evaluations to `eval_app`."""
    from .batch import bench_batch_command
    from .decode import bench_decode_command
    from .gpu import bench_gpu_command
    from .longctx import bench_longctx_command
    from .multiturn import bench_multiturn_command
    from .offload import bench_offload_command
    from .prefix import bench_prefix_command
    from .quant import bench_quant_command
    from .rag import eval_rag_command
    from .serve import bench_serve_command
    from .serve_chat import bench_serve_chat_command
    from .spec import bench_spec_command
    from .structured import bench_structured_command

    bench_serve = _needs_extras("kvboost bench serve", bench_serve_command, "server", modules=("openai",))
    bench_app.command("serve", help="Requests/s and TTFT under concurrent clients, reuse on vs off (needs the "
                                    "server extra and openai).")(
        _plot_needs_bench_extra("kvboost bench serve", bench_serve))
    bench_app.command("serve-chat", help="One streamed chat through kvboost serve against generate_stream(): "
                                         "decode rate and TTFT per turn (needs the server extra and openai).")(
        _needs_extras("kvboost bench serve-chat", bench_serve_chat_command, "server", modules=("openai",)))
    from .cluster import bench_cluster_command

    bench_app.command("cluster", help="KVBoost replicas on a local Ray cluster: KVBoost's router against Ray's "
                                      "default, round-robin and one replica, same chat and RAG replay (needs the "
                                      "cluster extra); --simulate R: the same routers over R simulated replicas.")(
        _plot_needs_bench_extra("kvboost bench cluster", bench_cluster_command))  # checks its extra unless --simulate
    bench_app.command("batch", help="Batched decode of rows sharing a prefix: shared-prefix attention on vs off.")(
        _plot_needs_bench_extra("kvboost bench batch", bench_batch_command))
    rag_help = "Multi-document QA: full prefill vs none / selective / cacheblend reuse (TTFT and fidelity)."
    eval_app.command("rag", help=rag_help)(_plot_needs_bench_extra("kvboost eval rag", eval_rag_command))
    bench_app.command("rag", help=rag_help)(_plot_needs_bench_extra("kvboost bench rag", eval_rag_command))
    bench_app.command("structured", help="JSON-schema constrained output: schema-valid rate, decode tok/s with and "
                                         "without the mask, compile ms (needs the structured extra).")(
        _plot_needs_bench_extra("kvboost bench structured", _needs_extras(
            "kvboost bench structured", bench_structured_command, "structured", modules=("jsonschema",))))
    bench_app.command("offload", help="INT4 weights against float ones and llama.cpp on a CPU (decode tok/s, peak "
                                      "RSS, teacher-forced agreement); with --device cuda, INT4 resident and "
                                      "streamed from host memory on a --shape.")(
        _plot_needs_bench_extra("kvboost bench offload", bench_offload_command))
    # Each takes --model/--shape/--device/--dtype (model_options).
    for name, command in (("prefix", bench_prefix_command), ("quant", bench_quant_command),
                          ("multiturn", bench_multiturn_command), ("decode", bench_decode_command),
                          ("gpu", bench_gpu_command), ("spec", bench_spec_command),
                          ("longctx", bench_longctx_command)):
        bench_app.command(name)(_plot_needs_bench_extra(f"kvboost bench {name}", command))
