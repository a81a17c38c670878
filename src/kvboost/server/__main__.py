"""`kvboost serve` / `kvboost-server`: load a model, warm it up, and serve the OpenAI-compatible API."""
from __future__ import annotations

import ipaddress
import logging
import signal
import threading
import time

import typer

from .. import __version__
from ..extras import require
from ..results import GenerationMode, RecomputeStrategy


def serve_command(
    model: str | None = typer.Option(None, "--model", "-m", help="Local path or Hugging Face id "
                                                                 "(default: embedded SmolLM2-135M-Instruct)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (loopback by default)."),
    port: int = typer.Option(8000, min=0, max=65535, help="TCP port (0: pick a free one)."),
    content_reuse: bool = typer.Option(False, help="Also reuse stored chunks found at other positions (RAG; "
                                                   "approximate, repaired with --recompute-strategy)."),
    recompute_strategy: RecomputeStrategy = typer.Option(RecomputeStrategy.SELECTIVE, case_sensitive=False,
                                                         help="Repair of K/V reused at other positions."),
    kv_cache_bits: int = typer.Option(16, help="Stored K/V precision: 16, 8 or 4 bits."),
    kv_dtype: str = typer.Option("auto", help="dtype of the K/V in memory and every tier: auto, model, bfloat16, "
                                              "float16, float32 (auto: bfloat16 for INT4 weights on a CPU with it)."),
    batch_window_ms: float = typer.Option(20.0, min=0.0, help="How long an idle worker waits to batch requests."),
    max_batch_size: int = typer.Option(16, min=1, help="Rows per batch (1: one request at a time)."),
    disk_cache_dir: str | None = typer.Option(None, help="Spill K/V chunks to this directory."),
    disk_budget_bytes: int | None = typer.Option(None, min=1, help="Bytes the disk tier may hold; the least used go "
                                                 "first (default: half of the free and held space, at most 16 GiB)."),
    redis_url: str | None = typer.Option(None, help="Share K/V chunks through Redis (redis://host:port/db)."),
    redis_ttl_s: int | None = typer.Option(24 * 3600, min=1, help="Seconds a chunk lives in Redis."),
    api_key: str | None = typer.Option(None, envvar="KVBOOST_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on /v1 routes."),
    served_model_name: str | None = typer.Option(None, help="Model name clients use (default: model's name)."),
    max_queue: int = typer.Option(256, min=1, help="Waiting requests before 429 Too Many Requests."),
    chunk_size: int = typer.Option(128, min=8, help="Tokens per cached K/V chunk."),
    chunk_boundary_window: int = typer.Option(0, min=0, help="Let chunk cuts slide up to this many tokens to a "
                                                            "sentence or word boundary (0: fixed cuts)."),
    reuse: GenerationMode = typer.Option(GenerationMode.CHUNK_KV_REUSE, "--reuse-mode", case_sensitive=False,
                                         help="K/V reuse for every request (baseline: none, for comparisons)."),
    device: str | None = typer.Option(None, help="cpu, cuda, mps (default: best available)."),
    dtype: str | None = typer.Option(None, help="float32, bfloat16, float16 (default: fp32 on CPU)."),
    warm: list[str] | None = typer.Option(None, "--warm", metavar="FILE", help=(
        "Store this system prompt's K/V before listening (repeatable): a text file is warmed as the system "
        "message of a chat, a .json file holding a list of chat messages as those messages. The first request "
        "that starts with it then costs what later ones do.")),
    speculative: str | None = typer.Option(None, help="Speculative decoding for every request: prompt_lookup "
                                                      "(n-gram drafts from prompt + output), draft (needs "
                                                      "--draft-model) or off. With batching, speculating rows "
                                                      "verify their drafts together in each step."),
    num_speculative_tokens: int = typer.Option(8, help="Most drafts verified per forward (1-15)."),
    draft_model: str | None = typer.Option(None, help="Draft model (path or hub id) sharing the tokenizer, for "
                                                      "--speculative draft."),
    weights: str = typer.Option("float", help="float, or int4: the Linear layers in INT4 (CPU; a GGUF's Q4 blocks "
                                              "as stored, else rounded in groups of 128). AWQ / GPTQ folders load "
                                              "as INT4 either way."),
    fast_path: str = typer.Option("auto", help="Short forwards over a static cache: auto (CUDA graphs on a GPU "
                                               "with the Triton kernels; on a CPU the decode step from its "
                                               "AOTInductor package, built in the background on first use), "
                                               "graphs, compiled (CPU: the decode steps, one request's and the "
                                               "batch's, under torch.compile), eager or off."),
    paged_kv: bool = typer.Option(False, hidden=True, help="Deprecated and ignored (one KV design: the workspace)."),
    memory_budget_bytes: int | None = typer.Option(None, min=0, help="Bytes of stored K/V kept in memory (on a GPU: "
                                                   "host memory); the least used go first (default: a quarter of "
                                                   "RAM, at most 4 GiB)."),
    device_kv_budget_bytes: int | None = typer.Option(None, min=0, help="Stored K/V kept on the GPU; colder chunks "
                                                      "move to host memory (default on CUDA: 30%% of free device "
                                                      "memory)."),
    device_kv_max_tokens: int | None = typer.Option(None, min=1, help="Longer contexts keep their K/V in host "
                                                    "memory, streamed to the device a layer at a time (exact reuse "
                                                    "only)."),
    weight_budget_bytes: int | None = typer.Option(None, min=1, help="Device bytes for the weights: decoder layers "
                                                   "that do not fit stream from host memory a layer at a time."),
    weight_prefetch_depth: int | None = typer.Option(None, min=1, help="With --weight-budget-bytes: device slots for "
                                                     "streamed layers, copies up to this many - 1 layers ahead "
                                                     "(default 2)."),
    kv_events: str | None = typer.Option(None, help="Publish the chunks this server stores and drops as vLLM's KV "
                                         "events on this ZMQ endpoint (e.g. tcp://*:5557), for KV-aware routers."),
    log_level: str = typer.Option("info", help="uvicorn log level."),
    access_log: bool = typer.Option(False, help="Log one line per request: method, path, status, ms, and the "
                                                "prompt / cached / completion tokens."),
    replicas: int = typer.Option(0, min=0, help="Serve N replicas on Ray Serve behind one endpoint, each request "
                                                "routed to the replica holding most of its K/V (needs the cluster "
                                                "extra; 0: this process serves alone)."),
    ray_address: str | None = typer.Option(None, help="With --replicas: join this Ray cluster (default: start a "
                                                      "local one-node cluster)."),
    route_imbalance: int = typer.Option(4, min=1, help="With --replicas: queued requests beyond the least-loaded "
                                                       "replica's at which a request goes there instead of to its "
                                                       "K/V."),
) -> None:
    """Serve an OpenAI-compatible API (chat, completions, streaming) with KV-cache reuse across requests.

    Sampling follows OpenAI: temperature omitted means 1.0 (sampling); send temperature=0 for greedy output.
    """
    require("kvboost serve", "server")  # before anything loads: a one-line hint, not an ImportError
    if replicas:
        require("kvboost serve --replicas", "cluster")
    elif ray_address is not None:
        typer.echo("kvboost serve: --ray-address needs --replicas N", err=True)
        raise typer.Exit(2)
    import uvicorn

    from .. import KVBoost
    from ..config import EngineConfig
    from .app import create_app, warm_up
    from .background import bind_socket
    from .settings import ServerSettings

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        settings = ServerSettings(model=model, served_model_name=served_model_name, host=host, port=port,
                                  api_key=api_key, max_queue=max_queue, max_batch_size=max_batch_size,
                                  batch_window_ms=batch_window_ms, mode=reuse, access_log=access_log,
                                  kv_events=kv_events)
        options = dict(content_reuse=content_reuse, recompute_strategy=recompute_strategy, kv_cache_bits=kv_cache_bits,
                       kv_dtype=kv_dtype, disk_cache_dir=disk_cache_dir, disk_budget_bytes=disk_budget_bytes,
                       redis_url=redis_url, redis_ttl_s=redis_ttl_s, chunk_size=chunk_size,
                       chunk_boundary_window=chunk_boundary_window, speculative=speculative,
                       num_speculative_tokens=num_speculative_tokens, fast_path=fast_path,
                       memory_budget_bytes=memory_budget_bytes, device_kv_budget_bytes=device_kv_budget_bytes,
                       device_kv_max_tokens=device_kv_max_tokens, weight_budget_bytes=weight_budget_bytes,
                       weight_prefetch_depth=weight_prefetch_depth, **({"paged_kv": True} if paged_kv else {}))
        config = EngineConfig.from_kwargs(**options)  # bad values fail now, not after the model has loaded
        check_speculative_flags(config.speculative, draft_model)
        warm_messages = [read_warm_file(path) for path in warm or []]
        if replicas:
            from ..cluster.deploy import ReplicaSpec
            from ..cluster.launch import serve_replicas

            load = dict(options, device=device, dtype=dtype, draft_model=draft_model, weights=weights)
            spec = ReplicaSpec(settings, load, warm_messages)
            serve_replicas(spec, replicas, ray_address, route_imbalance, log_level)
            return
        t0 = time.perf_counter()
        if config.fast_path == "compiled":  # minutes without output otherwise
            batched = ["batched decode"] + (["batched verify"] if config.speculative else [])
            steps = ["decode"] + (["verify"] if config.speculative else []) + (batched if max_batch_size > 1 else [])
            named = ", ".join(steps[:-1]) + " and " + steps[-1] if len(steps) > 1 else steps[0]
            typer.echo(f"kvboost serve: loading the model and compiling its {named} steps "
                       f"(--fast-path compiled: about a minute each on a small CPU)")
        engine = KVBoost.from_pretrained(model, device=device, dtype=dtype, draft_model=draft_model, weights=weights,
                                         **options)
        load_s = time.perf_counter() - t0
        sock = bind_socket(host, port)
    except (ValueError, OSError, ImportError) as exc:  # json.JSONDecodeError is a ValueError
        typer.echo(f"kvboost serve: {exc}", err=True)
        raise typer.Exit(2) from None
    t0 = time.perf_counter()
    try:
        warmed = sum(engine.warm(messages=messages).tokens for messages in warm_messages)
    except ValueError as exc:
        typer.echo(f"kvboost serve: --warm: {exc}", err=True)
        raise typer.Exit(2) from None
    warm_prompts_s = time.perf_counter() - t0
    try:
        app = create_app(engine, settings)
    except ValueError as exc:  # --kv-events that cannot bind
        sock.close()
        typer.echo(f"kvboost serve: {exc}", err=True)
        raise typer.Exit(2) from None
    # One short generation before "listening": the first client must not pay for first-call initialisation.
    try:
        warm_s = warm_up(app)
    except Exception as exc:  # a server that cannot generate must not claim to be listening
        app.state.kvboost.scheduler.stop()
        sock.close()
        typer.echo(f"kvboost serve: the warm-up generation failed: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None
    for line in startup_lines(engine, settings, app.state.kvboost.scheduler, load_s, warm_s):
        typer.echo(line)
    if warm_messages:
        typer.echo(f"  warmed {len(warm_messages)} prompt(s), {warmed:,} tokens, in {warm_prompts_s:.1f} s")
    bound = sock.getsockname()
    shown_host = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    typer.echo(f"KVBoost server listening on http://{shown_host}:{bound[1]}  (model '{settings.model_id}'"
               f"{', API key required' if settings.api_key else ''})")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        loopback = False
    if not settings.api_key and not loopback:
        typer.echo("warning: listening beyond loopback without --api-key; anyone who can reach it can use it", err=True)
    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",  # the app writes its own
                            timeout_graceful_shutdown=10)
    run_on_main_thread(uvicorn.Server(config), sock, app.state.kvboost.scheduler)


def run_on_main_thread(server, sock, scheduler) -> None:
    """HTTP on its own thread, the engine's loop on the main one (Scheduler.run_here); a 2nd Ctrl-C exits at once."""
    def handle_exit(signum, frame) -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle_exit)
    scheduler.run_in_caller()  # before HTTP starts: no request can meet the warm-up's worker being stopped
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="kvboost-http", daemon=True)
    http.start()
    # However uvicorn ends (shutdown, a failure to start), the loop here ends with it.
    threading.Thread(target=lambda: (http.join(), scheduler.stop()), name="kvboost-http-watch", daemon=True).start()
    scheduler.run_here()
    http.join()


def check_speculative_flags(speculative: str | None, draft_model: str | None) -> None:
    """ValueError for flag combinations that cannot run (never a silently ignored flag)."""
    if speculative == "draft" and draft_model is None:
        raise ValueError("--speculative draft needs --draft-model")
    if draft_model is not None and speculative != "draft":
        raise ValueError("--draft-model is used only with --speculative draft")


def read_warm_file(path: str) -> list[dict]:
    """Chat messages to warm from a --warm file: a JSON list of messages, or text used as the system message."""
    import json
    from pathlib import Path

    from ..prompting import validate_messages

    text = Path(path).read_text(encoding="utf-8")
    if path.endswith(".json"):
        messages = json.loads(text)
        validate_messages(messages)
        return messages
    if not text.strip():
        raise ValueError(f"{path} is empty")
    return [{"role": "system", "content": text}]


def startup_lines(engine, settings, scheduler, load_s: float, warm_s: float) -> list[str]:
    """What an operator needs to know before the first request: hardware, model limits, cache, batching."""
    config = engine.config
    context = f"{engine.max_context:,} tokens" if engine.max_context else "not declared"
    dtype, kv_dtype = engine.plan.dtype, str(engine.kv_dtype).removeprefix("torch.")
    tiers = ", ".join(_tier_line(name, tier, config) for name, tier in engine.cache_stats()["tiers"].items())
    reuse = settings.mode.value + (", content reuse " + config.recompute_strategy.value if config.content_reuse else "")
    batching = (f"continuous batching (max {scheduler.max_batch_size} rows), {scheduler.batch_window_s * 1e3:g} ms "
                "window" if scheduler.batched else "one request at a time")
    return [
        f"KVBoost {__version__}: model '{settings.model_id}' on {engine.device}, {dtype}, context {context}; "
        f"loaded in {load_s:.1f} s, warmed up in {warm_s:.1f} s",
        f"  K/V cache: {tiers}; {kv_dtype} K/V in chunks of {config.chunk_size} tokens stored at "
        f"{config.kv_cache_bits} bits; reuse {reuse}",
        f"  batching: {batching}; queue {settings.max_queue}; fast path: "
        f"{engine.fast_path_reason}; Linear products: {engine.cpu_linear}",
    ]


def _tier_line(name: str, tier: dict, config) -> str:
    n = tier.get("budget_bytes")
    where = {"disk": config.disk_cache_dir, "redis": config.redis_url}.get(name)
    size = f"{n / 1024**3:.1f} GiB" if n and n >= 1024**3 else f"{(n or 0) / 1024**2:.0f} MiB"
    return name + (f" {where}" if where else "") + (f" budget {size}" if n else "")


def main() -> None:
    """Console script `kvboost-server`."""
    from ..cli_help import HelpTyper

    app = HelpTyper(add_completion=False)  # what typer.run builds, with kvboost's readable --help
    app.command()(serve_command)
    app()


if __name__ == "__main__":
    main()
