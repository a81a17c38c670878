"""`kvboost bench decode`: decode tokens/s of KVBoost's runner modes beside plain transformers, in one run.

One prompt (a ~1,000-token prefix and a short question, the rows of `kvboost bench gpu`'s decode section), or with
--batch N that many prompts of the same length decoded together (KVBoost's generate_batch, HF generate over the
batch), greedy, on the same weights:
  hf generate        model.generate with its default DynamicCache
  hf static          model.generate over a StaticCache (not compiled; --compile-hf compiles it, minutes on a CPU)
  kvboost off        fast_path="off": the eager forward over a growing DynamicCache
  kvboost <mode>     the static-workspace runner: "compiled" on a CPU (torch.compile of the decode step),
                     "graphs" on CUDA (captured decode steps), and "eager" (the same static path, not compiled)
  kvboost auto       on a CPU, the default: the decode step from its AOTInductor package (model/aot_build.py);
                     load s includes building it where this run found none in the cache (then said)

Each KVBoost mode gets its own engine built from the same checkpoint. Decode rate = (tokens(N) - tokens(1)) / (time(N) -
time(1)) so prefill cancels out (bench/gpu/decode.py's `measure`). Greedy outputs are compared to HF generate's.
"""
from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Annotated

import typer

from .console import bench_console
from .model_options import DeviceOption, DtypeOption, ModelChoice, ModelOption, ShapeOption, load_engine, model_choice


def _runner_modes(device_type: str) -> tuple[str, ...]:
    return ("eager", "compiled", "auto") if device_type == "cpu" else ("eager", "graphs")


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """A row's tokens before its first EOS: what KVBoost reports as output tokens (HF keeps the EOS, and pads a
    finished row of a batch until every row has finished)."""
    end = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:end]


def _hf_call(model, rows: list[list[int]], pad: int, eos: set[int], outputs: dict, name: str, static: bool,
             compiled: bool) -> Callable:
    """HF generate over `rows` (all the same length: no padding) -> tokens generated in all."""
    import torch

    from kvboost.model.cpu_linear import model_own_products

    x = torch.tensor(rows, device=model.device)

    def call(n: int) -> int:
        kwargs = {}
        if static:
            from transformers import StaticCache

            from kvboost.model.cache_arg import cache_kwargs

            kwargs.update(cache_kwargs(StaticCache(config=model.config, max_cache_len=x.shape[1] + n)))
        with model_own_products(model):  # plain transformers as users run it, not the engine's CPU products
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                 do_sample=False, pad_token_id=pad, disable_compile=not compiled, **kwargs)
        outputs[name] = [_until_eos(row, eos) for row in out[:, x.shape[1]:].tolist()]
        return sum(len(row) for row in outputs[name])
    return call


def _own_products(model, call: Callable, n: int) -> int:
    from kvboost.model.cpu_linear import model_own_products

    with model_own_products(model):
        return call(n)


def _kvboost_call(engine, rows: list[list[int]], outputs: dict, name: str) -> Callable:
    """generate for one row, generate_batch for more -> tokens generated in all."""
    def call(n: int) -> int:
        if len(rows) == 1:
            results = [engine.generate(input_ids=rows[0], max_new_tokens=n)]
        else:
            results = engine.generate_batch(input_ids=rows, max_new_tokens=n)
        outputs[name] = [list(r.output_token_ids) for r in results]
        return sum(r.generated_tokens for r in results)
    return call


def run_decode_bench(choice: ModelChoice, prompt_tokens: int, new_tokens: int, repeats: int, compile_hf: bool,
                     json_path: str | None = None, plot_path: str | None = None, batch: int = 1) -> dict:
    import torch

    from .gpu.decode import decode_rows, measure
    from .plots import save_tok_s

    console = bench_console()
    device = torch.device(choice.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    outputs: dict[str, list[int]] = {}
    rows: list[dict] = []
    report: dict = {"benchmark": "decode", "prompt_tokens": None, "batch": batch, "new_tokens": new_tokens,
                    "repeats": repeats, "threads": torch.get_num_threads(), "rows": rows}

    def add(name: str, call: Callable, load_s: float = 0.0) -> None:
        with console.status(f"{name}: decoding"), torch.inference_mode():
            row = {"system": name, "load_s": load_s, **measure(call, new_tokens, device, repeats)}
        rows.append(row)
        console.print(f"{name:>18}: {row['decode_tok_s']:7.1f} tok/s")

    import time

    with console.status("loading model (kvboost off + baselines)"):
        engine = load_engine(choice, fast_path="off")
    report.update(choice.record(engine))
    tok, model = engine.tokenizer, engine.model
    prompts = decode_rows(tok, prompt_tokens, batch)
    report["prompt_tokens"] = len(prompts[0])
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = set(engine.eos_token_ids)
    add("hf generate", _hf_call(model, prompts, pad, eos, outputs, "hf generate", static=False, compiled=False))
    add("hf static" + ("+compile" if compile_hf else ""),
        _hf_call(model, prompts, pad, eos, outputs, "hf static", static=True, compiled=compile_hf))
    add("kvboost off", _kvboost_call(engine, prompts, outputs, "kvboost off"))
    if engine.cpu_linear.startswith("W @ x^T"):  # the same engine with the model's own Linear products: the A/B
        name = "kvboost off, cpu_linear off"
        own = _kvboost_call(engine, prompts, outputs, name)
        add(name, lambda n, m=model: _own_products(m, own, n))
    del engine, model
    gc.collect()
    for mode in _runner_modes(device.type):
        t0 = time.perf_counter()
        note = " (the warm-up compiles the decode step)" if mode == "compiled" else ""
        if mode == "compiled" and batch > 1:
            note = " (the warm-up compiles the decode step; the untimed first batch, the batched one)"
        with console.status(f"loading kvboost {mode}{note}"):
            engine = load_engine(choice, fast_path=mode)
        package = getattr(engine.runner, "package", None)
        if package is not None and package.building:
            with console.status("kvboost auto: building the decode-step package (once per model and machine)"):
                while package.building:
                    time.sleep(0.5)
            note = "built this run"
        name = f"kvboost {mode}"
        add(name, _kvboost_call(engine, prompts, outputs, name), time.perf_counter() - t0)
        rows[-1]["decode_kernels"] = engine.cache_stats()["fast_path"].get("decode_kernels")
        if package is not None:
            rows[-1]["package"] = note if note == "built this run" else "loaded from the cache"
        del engine
        gc.collect()
    reference = outputs.get("hf generate")
    base = next(r["decode_tok_s"] for r in rows if r["system"] == "kvboost off")
    for row in rows:
        key = "hf static" if row["system"].startswith("hf static") else row["system"]
        row["identical_to_hf_generate"] = outputs.get(key) == reference
        row["over_kvboost_off"] = row["decode_tok_s"] / base if base > 0 else float("nan")
    _print(console, report)
    save_tok_s(console, report, json_path, plot_path,
               f"Decode, batch {batch}, {report['prompt_tokens']}-token prompts ({device.type}, {report['threads']} "
               f"threads)")
    return report


def _print(console, report: dict) -> None:
    from rich.table import Table

    table = Table(title=f"decode, batch {report['batch']}, {report['prompt_tokens']}-token prompts, "
                        f"{report['new_tokens']} greedy tokens per row, {report['threads']} threads")
    for col in ("system", "decode tok/s", "ms/token", "vs kvboost off", "same tokens as HF", "load s"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in report["rows"]:
        rate = r["decode_tok_s"]
        table.add_row(r["system"], f"{rate:,.1f}", f"{1e3 / rate:,.1f}" if rate > 0 else "-",
                      f"{r['over_kvboost_off']:.2f}x", "yes" if r["identical_to_hf_generate"] else "NO",
                      f"{r['load_s']:.0f}" if r["load_s"] else "")
    console.print(table)
    console.print("decode rate (tokens of every row) from two runs that differ only in the number of steps "
                  "(prefill cancels out); load s: engine build and warm-up, including torch.compile for the "
                  "compiled mode and, for auto, the package build where the cache had none")
    for r in report["rows"]:
        if "package" in r:
            console.print(f"{r['system']}: decode-step package {r['package']}")


def bench_decode_command(
    model: ModelOption = None, shape: ShapeOption = None, device: DeviceOption = None, dtype: DtypeOption = None,
    prompt: Annotated[int, typer.Option("--prompt", min=16, help="Prompt length in tokens (prefix part).")] = 1000,
    new_tokens: Annotated[int, typer.Option("--new-tokens", min=2, help="Greedy tokens in the long run.")] = 64,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed runs of each length (median).")] = 3,
    batch: Annotated[int, typer.Option("--batch", min=1, max=16, help="Prompts decoded together (KVBoost: "
                                                                     "generate_batch).")] = 1,
    threads: Annotated[int | None, typer.Option("--threads", min=1, help="torch.set_num_threads for the run "
                                                                           "(default: torch's own).")] = None,
    compile_hf: Annotated[bool, typer.Option("--compile-hf", help="Compile HF's static-cache generate too "
                                                                  "(minutes on a CPU).")] = False,
    json_path: Annotated[str | None, typer.Option("--json", help="Write the results as JSON.")] = None,
    plot_path: Annotated[str | None, typer.Option("--plot", help="Write a PNG of tokens/s per system.")] = None,
) -> None:
    """Decode tokens/s: KVBoost's runner modes (off, eager, compiled or graphs) beside HF generate, batch 1 or
    --batch N prompts together."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    report = run_decode_bench(model_choice(model, shape, device, dtype), prompt, new_tokens, repeats, compile_hf,
                              json_path, plot_path, batch)
    same = all(r["identical_to_hf_generate"] for r in report["rows"])
    raise typer.Exit(0 if same else 1)
