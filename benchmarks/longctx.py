"""`kvboost bench longctx`: decoding a context longer than the device may hold, against the transfer bound.

One long prompt (workload text, --context tokens), greedy, batch 1, the same weights:
  resident  the whole context on the device (fast_path="off": the eager forward, as streamed runs)
  streamed  device_kv_max_tokens at --device-fraction (default 25%) of the context: the context lives in a host
            workspace, its first positions also on the device, and every forward brings the rest to the device one
            layer at a time
  bound     the host-to-device bound: measured copy bandwidth / bytes the streamed run moved per decode step
            (its own count, cache_stats()["streamed"], over one extra untimed pair of runs); on a
            CPU "device" and host are the same memory, the bandwidth is a plain copy's and nothing overlaps the
            copies with compute

Decode rate = (tokens(N) - tokens(1)) / (time(N) - time(1)) (bench/gpu/decode.py's `measure`), so the prefill
cancels out (after the untimed first run the context is stored: both engines map it). Greedy outputs of the two
engines are compared token for token.
"""
from __future__ import annotations

import gc
from typing import Annotated

import typer

from .console import bench_console
from .model_options import DeviceOption, DtypeOption, ModelChoice, ModelOption, ShapeOption, load_engine, model_choice

COPY_MB = 256


def copy_bandwidth(device, repeats: int = 5) -> float:
    """Bytes/s of one COPY_MB host-to-device copy (pinned host memory on CUDA), median of `repeats`."""
    import torch

    from .gpu.timing import median, timed

    n = COPY_MB << 20
    src = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
    src.fill_(1)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    dst.copy_(src)  # first touch: page faults and allocator work are not bandwidth
    ms = median([timed(lambda: dst.copy_(src, non_blocking=True), device)[0] for _ in range(repeats)])
    return n / (ms / 1e3)


def run_longctx_bench(choice: ModelChoice, context: int, new_tokens: int, repeats: int, fraction: float,
                      json_path: str | None = None, plot_path: str | None = None,
                      profile_path: str | None = None) -> dict:
    import torch

    from kvboost import KVBoost
    from kvboost.kv.long_context import bytes_per_position

    from .gpu.decode import measure
    from .plots import write_json
    from .prefix import prefix_text

    console = bench_console()
    with console.status("loading model (resident engine)"):
        resident = load_engine(choice, fast_path="off")
    model, tok, device = resident.model, resident.tokenizer, resident.device
    ids = tok(prefix_text(tok, context), add_special_tokens=False)["input_ids"][:context]
    token_bytes = bytes_per_position(resident.workspace_shapes, resident.kv_dtype)
    kv_bytes = (len(ids) + new_tokens) * token_bytes
    budget = int(kv_bytes * fraction)
    max_tokens = max(1, int((len(ids) + new_tokens) * fraction))
    streaming = KVBoost(model, tok, fast_path="off", device_kv_budget_bytes=budget,
                        device_kv_max_tokens=max_tokens, memory_budget_bytes=max(2 * kv_bytes, 1 << 30))
    streaming.long_contexts.staged = True  # a CPU too runs the GPU's path (copies into device buffers): its rehearsal
    report: dict = {"benchmark": "longctx", **choice.record(resident), "context_tokens": len(ids),
                    "new_tokens": new_tokens, "repeats": repeats, "threads": torch.get_num_threads(),
                    "kv_bytes": kv_bytes, "device_fraction": fraction, "device_kv_budget_bytes": budget,
                    "device_kv_max_tokens": max_tokens, "rows": []}
    outputs: dict[str, list[int]] = {}

    def call(engine, name: str):
        def run(n: int) -> int:
            result = engine.generate(input_ids=ids, max_new_tokens=n)
            outputs[name] = list(result.output_token_ids)
            return result.generated_tokens
        return run

    rates = {}
    for name, engine in (("resident", resident), ("streamed", streaming)):
        with console.status(f"{name}: decoding over {len(ids):,} tokens"), torch.inference_mode():
            before = engine.cache_stats()["streamed"]
            row = {"system": name, **measure(call(engine, name), new_tokens, device, repeats)}
            after = engine.cache_stats()["streamed"]
            if name == "streamed":  # untimed: bytes per decode step = (moved by n tokens - by 1 token) / (n - 1)
                row["streamed_requests"] = after["sequences"] - before["sequences"]
                moved = []
                for n in (1, new_tokens):
                    start = engine.cache_stats()["streamed"]["bytes_to_device"]
                    call(engine, name)(n)
                    moved.append(engine.cache_stats()["streamed"]["bytes_to_device"] - start)
                row["bytes_per_step"] = (moved[1] - moved[0]) / (new_tokens - 1)
                row["host_pinned"] = after["pinned"]  # pageable host memory copies synchronously
        rates[name] = row["decode_tok_s"]
        report["rows"].append(row)
        console.print(f"{name:>9}: {row['decode_tok_s']:7.2f} tok/s")
    with console.status("host-to-device copy bandwidth"):
        bandwidth = copy_bandwidth(device)
    streamed = report["rows"][1]
    bound = bandwidth / streamed["bytes_per_step"] if streamed["bytes_per_step"] else float("nan")
    # What streaming adds to a step, against what its bytes cost at the measured bandwidth (1.0: the copies run
    # at full bandwidth and nothing else is added; on a GPU overlap with compute can push the extra below it).
    extra_ms = 1e3 / rates["streamed"] - 1e3 / rates["resident"]
    copy_ms = 1e3 * streamed["bytes_per_step"] / bandwidth
    report.update(extra_ms_per_step=extra_ms, copy_ms_per_step=copy_ms,
                  copy_ms_over_extra_ms=copy_ms / extra_ms if extra_ms > 0 else float("inf"))
    report.update(copy_bandwidth_gb_s=bandwidth / 1e9, bound_tok_s=bound,
                  streamed_over_bound=rates["streamed"] / bound, streamed_over_resident=rates["streamed"] /
                  rates["resident"], identical=outputs.get("streamed") == outputs.get("resident"))
    _print(console, report)
    if profile_path:
        with console.status("profiling one streamed request"):
            write_profile(profile_path, call(streaming, "streamed"), new_tokens, device)
        console.print(f"wrote {profile_path}")
    del resident, streaming
    gc.collect()
    if json_path:
        write_json(json_path, report)
        console.print(f"wrote {json_path}")
    if plot_path:
        from .plots import plot_bars

        plot_bars({"resident": rates["resident"], "streamed": rates["streamed"], "copy bound": bound},
                  f"Decode over {len(ids):,} tokens, device holds {fraction:.0%} ({device.type})", "", "tokens/s",
                  plot_path)
        console.print(f"wrote {plot_path}")
    return report


def write_profile(path: str, run, new_tokens: int, device) -> None:
    """torch.profiler's table of one streamed request (`run(new_tokens)`), heaviest ops first, host and (CUDA)
    device time: where a streamed step's time goes beyond its copies."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.inference_mode(), profile(activities=activities) as prof:
        run(new_tokens)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    averages = prof.key_averages()
    with open(path, "w") as f:
        for sort in ("self_cpu_time_total",) + (("self_device_time_total",) if device.type == "cuda" else ()):
            f.write(f"# one streamed request of {new_tokens} tokens, sorted by {sort}\n")
            f.write(averages.table(sort_by=sort, row_limit=40) + "\n\n")


def _print(console, report: dict) -> None:
    from rich.table import Table

    table = Table(title=f"decode over a {report['context_tokens']:,}-token context, device budget "
                        f"{report['device_fraction']:.0%} of its K/V ({report['kv_bytes'] / 1e6:,.0f} MB), "
                        f"{report['threads']} threads")
    for col in ("system", "decode tok/s", "MB moved / step", "vs copy bound", "vs resident"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in report["rows"]:
        streamed = r["system"] == "streamed"
        table.add_row(r["system"], f"{r['decode_tok_s']:,.2f}",
                      f"{r['bytes_per_step'] / 1e6:,.0f}" if streamed else "0",
                      f"{report['streamed_over_bound']:.0%}" if streamed else "",
                      f"{report['streamed_over_resident']:.2f}x" if streamed else "")
    table.add_row("copy bound", f"{report['bound_tok_s']:,.2f}", "", "", "")
    console.print(table)
    console.print(f"copy bandwidth {report['copy_bandwidth_gb_s']:.1f} GB/s ({COPY_MB} MB host-to-device copy); "
                  f"greedy outputs identical: {'yes' if report['identical'] else 'NO'}")
    console.print(f"streaming adds {report['extra_ms_per_step']:.1f} ms per step; its bytes take "
                  f"{report['copy_ms_per_step']:.1f} ms at that bandwidth ({report['copy_ms_over_extra_ms']:.0%})")
    if report["rows"][1].get("host_copy"):
        console.print(f"host blocks reach the device as: {report['rows'][1]['host_copy']}")


def bench_longctx_command(
    model: ModelOption = None, shape: ShapeOption = None, device: DeviceOption = None, dtype: DtypeOption = None,
    context: Annotated[int, typer.Option("--context", min=64, help="Context length in tokens.")] = 7000,
    new_tokens: Annotated[int, typer.Option("--new-tokens", min=2, help="Greedy tokens in the long run.")] = 16,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed runs of each length (median).")] = 3,
    fraction: Annotated[float, typer.Option("--device-fraction", min=0.01, max=0.99,
                                            help="Share of the context's K/V the device may hold.")] = 0.25,
    json_path: Annotated[str | None, typer.Option("--json", help="Write the results as JSON.")] = None,
    plot_path: Annotated[str | None, typer.Option("--plot", help="Write a PNG of tokens/s per row.")] = None,
    profile_path: Annotated[str | None, typer.Option(
        "--profile", help="Write torch.profiler's table of one streamed request (untimed) to this file.")] = None,
) -> None:
    """Decode over a context longer than the device may hold (streamed from host memory) against the resident
    run and the host-to-device copy bound."""
    report = run_longctx_bench(model_choice(model, shape, device, dtype), context, new_tokens, repeats, fraction,
                               json_path, plot_path, profile_path)
    raise typer.Exit(0 if report["identical"] else 1)
