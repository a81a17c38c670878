"""`kvboost bench offload`: INT4 weights against float ones, and against llama.cpp on the same GGUF, in one run.

CPU rows (batch-1 greedy decode over a ~1,000-token prompt, as `kvboost bench decode`), each in a process of its own
so its peak RSS is its own:
  float compiled   fp32 weights, fast_path="compiled" (torch.compile of the decode step)
  float auto       fp32 weights, the default fast path (the decode-step package)
  int4 off         INT4 layers and int8 head (weights="int4"), the eager forward
  int4 auto        the same weights, the decode-step package
  llama.cpp        `llama-bench -p 0 -n N -d <prompt>` on the model's GGUF (--llama-bench PATH), same threads
and the fidelity of the INT4 weights: greedy continuations of the fp32 engine on held-out prompts (first turns of
the bench conversations, not the demo's questions), teacher-forced through the INT4 model; a position agrees when
the INT4 model's argmax is the fp32 path's token. With --device cuda: INT4 on the GPU, resident and streamed from
host memory (weight_budget_bytes), on a random-weight --shape (offload_gpu.py).
"""
from __future__ import annotations

import json
import multiprocessing
import resource
import subprocess
import time
from typing import Annotated

import typer

from .console import bench_console
from .model_options import DeviceOption, ModelChoice, ModelOption, ShapeOption, model_choice

# row -> engine options (kv_dtype "auto" keeps INT4 K/V in bfloat16 where the CPU computes it natively: kv/dtype.py)
ROWS = {"float compiled": {"weights": "float", "fast_path": "compiled"},
        "float auto": {"weights": "float", "fast_path": "auto"},
        "int4 off": {"weights": "int4", "fast_path": "off"},
        "int4 auto, fp32 K/V": {"weights": "int4", "fast_path": "auto", "kv_dtype": "model"},
        "int4 auto": {"weights": "int4", "fast_path": "auto"}}


def _row(choice: ModelChoice, options: dict, prompt_tokens: int, new_tokens: int, repeats: int,
         threads: int) -> dict:
    """One engine in this (child) process: load s, decode tok/s, tokens, peak RSS."""
    import torch

    from .gpu.decode import decode_rows, measure
    from .model_options import load_engine

    torch.set_num_threads(threads)
    start = time.perf_counter()
    engine = load_engine(choice, **options)
    package = getattr(engine.runner, "package", None)
    while package is not None and package.building:
        time.sleep(0.5)
    load_s = time.perf_counter() - start
    prompt = decode_rows(engine.tokenizer, prompt_tokens, 1)[0]
    out: dict = {}

    def call(n: int) -> int:
        result = engine.generate(input_ids=prompt, max_new_tokens=n)
        out["tokens"] = list(result.output_token_ids)
        return result.generated_tokens

    with torch.inference_mode():
        row = measure(call, new_tokens, torch.device("cpu"), repeats)
    return {**row, "load_s": load_s, "output": out["tokens"], "prompt_tokens": len(prompt),
            "fast_path": engine.cache_stats()["fast_path"].get("mode"), "kv_dtype": str(engine.kv_dtype)[6:],
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _agreement(choice: ModelChoice, prompts: int, new_tokens: int, threads: int) -> dict:
    """Teacher-forced agreement of the INT4 model with the fp32 engine's greedy continuations."""
    import torch

    from kvboost.model.forward import forward_tokens

    from .model_options import load_engine
    from .workloads import load_conversations

    torch.set_num_threads(threads)
    engine = load_engine(choice, fast_path="off")
    chats = [[{"role": "system", "content": c["system"]}, {"role": "user", "content": c["turns"][0]}]
             for c in load_conversations()[:prompts]]
    pairs = []
    for chat in chats:
        ids = engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
        ids = list(ids["input_ids"])
        pairs.append((ids, list(engine.generate(input_ids=ids, max_new_tokens=new_tokens).output_token_ids)))
    del engine
    # Through the INT4 engine's own forward: its attention over its workspace, in its K/V dtype (kv_dtype="auto").
    int4 = load_engine(choice, fast_path="off", weights="int4")
    same = total = 0
    with torch.inference_mode(), int4.lock:
        for ids, tokens in pairs:
            logits = forward_tokens(int4.model, ids + tokens[:-1], int4.workspace.make_cache(0),
                                    logits_to_keep=len(tokens), attention=int4.attention)[0]
            same += int((logits.argmax(-1) == torch.tensor(tokens)).sum())
            total += len(tokens)
    return {"prompts": len(pairs), "positions": total, "agreeing": same, "agreement": same / max(total, 1),
            "kv_dtype": str(int4.kv_dtype).removeprefix("torch.")}


def _in_child(fn, *args) -> dict:
    pool = multiprocessing.get_context("spawn").Pool(1)
    try:
        return pool.apply(fn, args)
    finally:
        pool.close()
        pool.join()


def _llama_cpp(binary: str, gguf: str, prompt_tokens: int, new_tokens: int, repeats: int, threads: int) -> dict:
    """llama.cpp's best decode rate, flash attention off and on (its CPU default, on, measured 2.5x slower at 1k)."""
    cmd = [binary, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(new_tokens), "-d", str(prompt_tokens),
           "-r", str(repeats), "-fa", "0,1", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
    results = json.loads(done.stdout)
    by_fa = {f"flash_attn_{int(bool(r.get('flash_attn')))}": float(r["avg_ts"]) for r in results}
    return {"decode_tok_s": max(by_fa.values()), **by_fa, "command": " ".join(cmd),
            "build": results[0].get("build_commit")}


def run_offload_bench(choice: ModelChoice, prompt_tokens: int, new_tokens: int, repeats: int, threads: int,
                      llama_bench: str | None, agreement_prompts: int, json_path: str | None,
                      plot_path: str | None) -> dict:
    from kvboost.loading import embedded_gguf_path, is_embedded

    from .plots import save_tok_s

    console = bench_console()
    rows: list[dict] = []
    report: dict = {"benchmark": "offload", **choice.record(), "threads": threads, "new_tokens": new_tokens,
                    "repeats": repeats, "rows": rows}
    for name, options in ROWS.items():
        with console.status(f"{name}: loading (a package or compile is built where none is cached) and decoding"):
            row = _in_child(_row, choice, options, prompt_tokens, new_tokens, repeats, threads)
        rows.append({"system": name, "weights": options["weights"], **row})
        console.print(f"{name:>15}: {row['decode_tok_s']:7.1f} tok/s, peak RSS {row['peak_rss_mb']:,.0f} MB, "
                      f"load {row['load_s']:.0f} s")
    report["prompt_tokens"] = rows[0]["prompt_tokens"]
    if llama_bench:
        gguf = str(embedded_gguf_path()) if is_embedded(choice.model) else choice.model
        with console.status("llama.cpp: llama-bench"):
            row = _llama_cpp(llama_bench, gguf, report["prompt_tokens"], new_tokens, repeats, threads)
        rows.append({"system": "llama.cpp", "weights": "gguf", **row})
        console.print(f"{'llama.cpp':>15}: {row['decode_tok_s']:7.1f} tok/s")
    if agreement_prompts:
        with console.status(f"fidelity: {agreement_prompts} held-out prompts, teacher-forced"):
            report["agreement"] = _in_child(_agreement, choice, agreement_prompts, new_tokens, threads)
    _summarize(report)
    _print(console, report)
    save_tok_s(console, report, json_path, plot_path,
               f"Decode, batch 1, {report['prompt_tokens']}-token prompt (cpu, {threads} threads)")
    return report


def _summarize(report: dict) -> None:
    by = {r["system"]: r for r in report["rows"]}
    int4, compiled, auto = by["int4 auto"], by["float compiled"], by["float auto"]
    report["int4_over_float_compiled"] = int4["decode_tok_s"] / compiled["decode_tok_s"]
    report["int4_rss_over_float"] = int4["peak_rss_mb"] / auto["peak_rss_mb"]
    report["int4_over_fp32_kv"] = int4["decode_tok_s"] / by["int4 auto, fp32 K/V"]["decode_tok_s"]
    report["int4_kv_dtype"] = int4["kv_dtype"]
    if "llama.cpp" in by:
        report["int4_over_llama_cpp"] = int4["decode_tok_s"] / by["llama.cpp"]["decode_tok_s"]
    report["float_rows_same_tokens"] = compiled["output"] == auto["output"]
    report["int4_rows_same_tokens"] = by["int4 off"]["output"] == int4["output"]


def _print(console, report: dict) -> None:
    from rich.table import Table

    table = Table(title=f"offload (cpu): batch-1 decode, {report['prompt_tokens']}-token prompt, "
                        f"{report['threads']} threads")
    for col in ("system", "decode tok/s", "ms/token", "peak RSS MB", "load s"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in report["rows"]:
        rate = r["decode_tok_s"]
        table.add_row(r["system"], f"{rate:,.1f}", f"{1e3 / rate:,.2f}", f"{r['peak_rss_mb']:,.0f}"
                      if "peak_rss_mb" in r else "", f"{r['load_s']:.0f}" if "load_s" in r else "")
    console.print(table)
    console.print(f"int4 auto / float compiled: {report['int4_over_float_compiled']:.2f}x; peak RSS int4 auto / "
                  f"float auto: {report['int4_rss_over_float']:.2f}")
    console.print(f"int4 auto ({report['int4_kv_dtype']} K/V) / int4 auto, fp32 K/V: "
                  f"{report['int4_over_fp32_kv']:.2f}x")
    if "int4_over_llama_cpp" in report:
        console.print(f"int4 auto / llama.cpp: {report['int4_over_llama_cpp']:.2f}x")
    if "agreement" in report:
        a = report["agreement"]
        console.print(f"teacher-forced agreement with fp32: {a['agreement']:.1%} of {a['positions']} positions "
                      f"({a['prompts']} prompts; INT4 engine's K/V in {a['kv_dtype']})")
    console.print(f"same tokens: float rows {report['float_rows_same_tokens']}, int4 rows "
                  f"{report['int4_rows_same_tokens']}")


def bench_offload_command(
    model: ModelOption = None, shape: ShapeOption = None, device: DeviceOption = None,
    prompt: Annotated[int, typer.Option("--prompt", min=16, help="Prompt length in tokens (prefix part).")] = 1000,
    new_tokens: Annotated[int, typer.Option("--new-tokens", min=2, help="Greedy tokens in the long run, and per "
                                                                        "fidelity prompt.")] = 64,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed runs of each length (median).")] = 3,
    threads: Annotated[int, typer.Option("--threads", min=1, help="Threads of every row, llama.cpp's too.")] = 2,
    llama_bench: Annotated[str | None, typer.Option("--llama-bench", help="A llama.cpp `llama-bench` binary: adds "
                                                                          "its row on the model's GGUF.")] = None,
    agreement_prompts: Annotated[int, typer.Option(
        "--agreement-prompts", min=0, help="Held-out prompts of the fidelity check (0: none).")] = 48,
    json_path: Annotated[str | None, typer.Option("--json", help="Write the results as JSON.")] = None,
    plot_path: Annotated[str | None, typer.Option("--plot", help="Write a PNG of tokens/s per system.")] = None,
    prefetch_depths: Annotated[str, typer.Option("--prefetch-depths", help="With --device cuda: also stream every "
                                                 "layer through this many device slots, one row each (e.g. 1,3,4)."
                                                 )] = "",
    weight_budget_gb: Annotated[float | None, typer.Option("--weight-budget-gb", min=0.1, help="With --device cuda: "
                                                           "also a row with this device budget for the weights, "
                                                           "in GiB.")] = None,
    draft_shape: Annotated[str | None, typer.Option("--draft-shape", help="With --device cuda: a resident draft of "
                                                    "this random-weight shape over the all-streamed target (default "
                                                    "qwen2.5-0.5b; 'none': no such row).")] = None,
) -> None:
    """INT4 weights against float ones (decode tok/s, peak RSS, teacher-forced agreement) and llama.cpp, on a CPU;
    with --device cuda, INT4 resident and streamed against bf16 and transformers' offloading on a --shape."""
    if device is not None and device.startswith("cuda"):
        from .offload_gpu import run_offload_gpu

        if model is not None:
            raise typer.BadParameter("the GPU rows run on random weights: use --shape", param_hint="--model")
        if draft_shape not in (None, "none"):
            from .shapes import UnknownShapeError, get_shape

            try:
                get_shape(draft_shape)
            except UnknownShapeError as exc:
                raise typer.BadParameter(str(exc), param_hint="--draft-shape") from None
        choice = model_choice(shape=shape or "qwen2.5-3b", device=device)
        try:
            depths = tuple(int(d) for d in prefetch_depths.split(",") if d.strip())
        except ValueError:
            raise typer.BadParameter("a comma-separated list of ints", param_hint="--prefetch-depths") from None
        report = run_offload_gpu(choice, new_tokens, json_path, plot_path, depths, weight_budget_gb,
                                 None if draft_shape == "none" else draft_shape or "qwen2.5-0.5b")
        raise typer.Exit(0 if all(r.get("status") == "ok" for r in report["rows"]) else 1)
    if prefetch_depths or weight_budget_gb is not None or draft_shape is not None:
        raise typer.BadParameter("--prefetch-depths, --weight-budget-gb and --draft-shape are GPU rows (--device cuda)",
                                 param_hint="--prefetch-depths")
    if shape is not None or (device is not None and device != "cpu"):
        raise typer.BadParameter("the CPU rows run the --model checkpoint on the CPU (its GGUF for llama.cpp); "
                                 "--shape is for --device cuda", param_hint="--shape")
    choice = model_choice(model, device="cpu")
    report = run_offload_bench(choice, prompt, new_tokens, repeats, threads, llama_bench, agreement_prompts,
                               json_path, plot_path)
    raise typer.Exit(0 if report["float_rows_same_tokens"] else 1)
