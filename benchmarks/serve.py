"""`kvboost bench serve`: requests/s and TTFT of the live server with K/V reuse on versus off, in one run.

One engine, two servers on 127.0.0.1 one after the other: reuse off (every request a full prefill,
GenerationMode.BASELINE) and reuse on (CHUNK_KV_REUSE). Each run has N concurrent openai-SDK clients
(default 16), each sending R streaming chat requests that share a ~1,000-token system prompt and ask
different questions. TTFT is measured by the client: from sending the request to the first chunk with
text (the role chunk that opens every stream does not count). Before each run one untimed request warms
the server (for reuse on, it puts the system prompt in the cache, as a server that has been up would
have it). Targets: >= 2x requests/s and >= 3x lower p50 TTFT with reuse on.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Annotated

import typer

from .console import bench_console
from .model_options import DeviceOption, DtypeOption, ModelChoice, ModelOption, ShapeOption, as_choice, model_choice

TARGET_RPS_GAIN = 2.0
TARGET_TTFT_GAIN = 3.0


@dataclass
class ServeRun:
    mode: str
    requests: int
    errors: int
    wall_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    latency_p50_ms: float
    mean_cached_tokens: float
    prompt_tokens: int


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


async def _drive(url: str, model: str, system: str, questions: list[str], clients: int, per_client: int,
                 max_tokens: int) -> tuple[list[float], list[float], list[int], int, float, int]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=900)
    ttfts: list[float] = []
    latencies: list[float] = []
    cached: list[int] = []
    errors = 0
    prompt_tokens = 0

    async def one(c: int) -> None:
        nonlocal errors, prompt_tokens
        for r in range(per_client):
            question = questions[(c * per_client + r) % len(questions)]
            t0 = time.perf_counter()
            first = None
            try:
                stream = await client.chat.completions.create(
                    model=model, max_tokens=max_tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True},
                    messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
                async for chunk in stream:
                    if first is None and chunk.choices and (chunk.choices[0].delta.content
                                                            or chunk.choices[0].finish_reason):
                        first = time.perf_counter() - t0
                    if chunk.usage is not None:
                        cached.append(chunk.usage.prompt_tokens_details.cached_tokens)
                        prompt_tokens = chunk.usage.prompt_tokens
            except Exception:  # counted; a benchmark reports failures rather than dying on them
                errors += 1
                continue
            ttfts.append((first if first is not None else time.perf_counter() - t0) * 1e3)
            latencies.append((time.perf_counter() - t0) * 1e3)

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(c) for c in range(clients)))
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    return ttfts, latencies, cached, errors, wall, prompt_tokens


def _warm(url: str, model: str, system: str) -> None:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=900)
    client.chat.completions.create(model=model, max_tokens=2, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "Hello! Who are you?"}])
    client.close()


def run_serve_bench(model: str | ModelChoice | None = None, clients: int = 16, requests_per_client: int = 4,
                    max_tokens: int = 16, max_batch_size: int = 16, batch_window_ms: float = 20.0,
                    progress=print) -> dict:
    from kvboost.results import GenerationMode
    from kvboost.server import BackgroundServer, ServerSettings, create_app

    from .model_options import load_engine
    from .workloads import load_system_prompt

    system, items = load_system_prompt()
    questions = [q["question"] for q in items]
    choice = as_choice(model)
    engine = load_engine(choice)
    # A shape has no checkpoint path to serve under; the server names it after the shape.
    served = {"served_model_name": f"shape-{choice.shape}"} if choice.shape else {}
    runs: list[ServeRun] = []
    for mode in (GenerationMode.BASELINE, GenerationMode.CHUNK_KV_REUSE):
        engine.clear_cache()
        settings = ServerSettings(model=choice.model, mode=mode, max_batch_size=max_batch_size,
                                  batch_window_ms=batch_window_ms, max_queue=max(256, clients * 2), **served)
        with BackgroundServer(create_app(engine, settings)) as srv:
            progress(f"[{mode.value}] warming up on {srv.base_url}")
            _warm(srv.base_url, settings.model_id, system)
            progress(f"[{mode.value}] {clients} clients x {requests_per_client} requests, max_tokens={max_tokens}")
            ttfts, lat, cached, errors, wall, n_prompt = asyncio.run(_drive(
                srv.base_url, settings.model_id, system, questions, clients, requests_per_client, max_tokens))
        done = len(ttfts)
        runs.append(ServeRun(mode.value, done, errors, wall, done / wall if wall > 0 else 0.0,
                             percentile(ttfts, 50), percentile(ttfts, 90), percentile(lat, 50),
                             sum(cached) / len(cached) if cached else 0.0, n_prompt))
    off, on = runs
    rps_gain = on.requests_per_s / off.requests_per_s if off.requests_per_s else float("nan")
    ttft_gain = off.ttft_p50_ms / on.ttft_p50_ms if on.ttft_p50_ms else float("nan")
    return {
        "benchmark": "serve", **choice.record(engine), "model": settings.model_id, "clients": clients,
        "requests_per_client": requests_per_client,
        "max_tokens": max_tokens, "max_batch_size": max_batch_size, "batch_window_ms": batch_window_ms,
        "runs": {r.mode: asdict(r) for r in runs},
        "requests_per_s_gain": rps_gain, "ttft_p50_gain": ttft_gain,
        "targets": {"requests_per_s_gain": TARGET_RPS_GAIN, "ttft_p50_gain": TARGET_TTFT_GAIN},
        "meets_targets": bool(rps_gain >= TARGET_RPS_GAIN and ttft_gain >= TARGET_TTFT_GAIN),
    }


def print_report(report: dict) -> None:
    from rich.table import Table

    table = Table(title=f"kvboost bench serve — {report['model']}, {report['clients']} concurrent clients, "
                        f"~{next(iter(report['runs'].values()))['prompt_tokens']}-token prompts")
    for col in ("reuse", "requests", "errors", "req/s", "TTFT p50 ms", "TTFT p90 ms", "latency p50 ms",
                "cached tokens/req"):
        table.add_column(col, justify="right")
    for r in report["runs"].values():
        table.add_row("off" if r["mode"] == "baseline" else "on", str(r["requests"]), str(r["errors"]),
                      f"{r['requests_per_s']:.2f}", f"{r['ttft_p50_ms']:.0f}", f"{r['ttft_p90_ms']:.0f}",
                      f"{r['latency_p50_ms']:.0f}", f"{r['mean_cached_tokens']:.0f}")
    console = bench_console()
    console.print(table)
    verdict = "meets" if report["meets_targets"] else "misses"
    console.print(f"reuse on: {report['requests_per_s_gain']:.2f}x requests/s (target {TARGET_RPS_GAIN:g}x), "
                  f"{report['ttft_p50_gain']:.2f}x lower p50 TTFT (target {TARGET_TTFT_GAIN:g}x) — {verdict} targets")


def plot_report(report: dict, path: str) -> None:
    """Grouped bars: TTFT p50/p90 and request latency p50 with reuse off and on (matplotlib imported here only)."""
    from .plots import plot_bars

    runs = {("reuse off" if r["mode"] == "baseline" else "reuse on"): r for r in report["runs"].values()}
    bars = {label: {mode: r[key] for mode, r in runs.items()}
            for label, key in (("TTFT p50", "ttft_p50_ms"), ("TTFT p90", "ttft_p90_ms"),
                               ("latency p50", "latency_p50_ms"))}
    rps = ", ".join(f"{mode} {r['requests_per_s']:.2f}" for mode, r in runs.items())
    plot_bars(bars, f"Server, {report['clients']} clients (requests/s: {rps})", "", "ms", path)


def bench_serve_command(
    model: ModelOption = None, shape: ShapeOption = None, device: DeviceOption = None, dtype: DtypeOption = None,
    clients: Annotated[int, typer.Option(min=1, help="Concurrent clients.")] = 16,
    requests: Annotated[int, typer.Option(min=1, help="Requests per client.")] = 4,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per request.")] = 16,
    max_batch_size: Annotated[int, typer.Option(min=1, help="Server batch size (1: one request at a time).")] = 16,
    batch_window_ms: Annotated[float, typer.Option(min=0.0, help="Server batch window.")] = 20.0,
    json_path: Annotated[str | None, typer.Option("--json", help="Write the results as JSON.")] = None,
    plot_path: Annotated[str | None, typer.Option("--plot", help="Write a PNG: TTFT and latency, reuse off vs on.")]
    = None,
) -> None:
    """Requests/s and p50/p90 TTFT of the OpenAI server, reuse on versus off, 16 clients sharing a system prompt."""
    report = run_serve_bench(model_choice(model, shape, device, dtype), clients, requests, max_tokens,
                             max_batch_size, batch_window_ms, progress=lambda m: typer.echo(m, err=True))
    print_report(report)
    if json_path:
        from .plots import write_json

        write_json(json_path, report)
        typer.echo(f"wrote {json_path}", err=True)
    if plot_path:
        plot_report(report, plot_path)
        typer.echo(f"wrote {plot_path}", err=True)
