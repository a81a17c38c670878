"""`kvboost bench offload --device cuda`: INT4 weights on a GPU, resident and streamed from host memory, against bf16.

Rows, on one random-weight --shape, batch-1 greedy decode over a ~1,000-token prompt (decode rate from two lengths, as
`kvboost bench gpu`'s section c), each with the device memory it peaked at:
  bf16                  the float model, resident (the engine's default fast path: CUDA graphs)
  int4 triton           random INT4 decoder layers (group 128, drawn on the device: shapes.build_int4_shape_model, no
                        float weight ever exists) on KVBoost's Triton W4A16 kernel, resident
  int4 tinygemm         the same codes on torch's `_weight_int4pack_mm`, resident
  int4 streamed 1/2     weight_budget_bytes keeps half the decoder layers resident, the rest stream through 2 slots
                        (the default CUDA kernel, torch's)
  int4 streamed all     every decoder layer streams (the embedding, head and norms stay)
  ..., graphs           the same with fast_path="graphs": decode steps captured over fixed slots
  int4 streamed, f%     weight_budget_bytes = f% of the packed model's bytes (25, 50)
  ... + draft           every layer streamed, a resident random draft shape proposing (speculative="draft"):
                        tokens per target pass (tau) and the bound times tau. Random weights agree by chance only,
                        so tau here tests the path and the adaptive policy, not what a real draft gains
  ..., depth d          the same through d device slots (--prefetch-depths), copies up to d - 1 layers ahead
  int4 streamed, B GB   weight_budget_bytes = B GiB (--weight-budget-gb), the plan choosing what stays resident
  hf device_map auto    transformers + accelerate offloading the bf16 model under the streamed-1/2 row's device budget
For the streamed rows, the bound at one token per pass: measured pinned host-to-device bandwidth / bytes streamed per
decode step. Every KVBoost row also gives TTFT at ~1k tokens (the one-token run) and at ~8k. Rows that fail are
reported with the reason; the run goes on.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch

from .console import bench_console
from .model_options import ModelChoice

PROMPT_TOKENS, LONG_PROMPT_TOKENS, REPEATS = 1000, 8000, 2


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _module_bytes(module: torch.nn.Module) -> int:
    return _nbytes([*module.parameters(), *module.buffers()])


def _h2d_gb_s(device: torch.device, mib: int = 512) -> float:
    """Pinned host-to-device copy bandwidth, GB/s (best of three)."""
    host = torch.empty(mib << 20, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device=device)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return host.numel() / best / 1e9


def _budget(model: torch.nn.Module, resident_layers: int, slots: int = 2) -> int:
    layers = model.model.layers
    per_layer = max(_module_bytes(layer) for layer in layers) + 64 * 32  # + each tensor's alignment in a slot
    return _module_bytes(model) - _module_bytes(layers) + (slots + resident_layers) * per_layer


def _row(name: str, build: Callable[[], tuple[Callable[[int], int], dict]], device: torch.device, n: int,
         console) -> dict:
    from .gpu.decode import measure

    gc.collect()  # the previous row's model and engine
    torch.cuda.empty_cache()
    row: dict = {"system": name}
    try:
        call, extra = build()
        with torch.inference_mode():
            row.update(measure(call, n, device, REPEATS), **extra, status="ok")
        row["peak_device_mb"] = torch.cuda.max_memory_allocated(device) / 2**20  # since the build (see its reset)
        console.print(f"{name:>20}: {row['decode_tok_s']:8.1f} tok/s, peak device {row['peak_device_mb']:,.0f} MB")
    except Exception as exc:  # a row that cannot run is reported, the next still runs
        row.update(status="error", reason=f"{type(exc).__name__}: {str(exc).strip()[:300]}")
        console.print(f"{name:>20}: {row['reason']}")
    return row


def run_offload_gpu(choice: ModelChoice, new_tokens: int, json_path: str | None, plot_path: str | None,
                    depths: tuple[int, ...] = (), budget_gb: float | None = None,
                    draft_shape: str | None = "qwen2.5-0.5b") -> dict:
    from kvboost import KVBoost

    from .gpu.decode import decode_rows
    from .plots import save_tok_s, write_json
    from .shapes import build_int4_shape_model, build_shape_model, embedded_tokenizer

    console = bench_console()
    device = torch.device(choice.device or "cuda")
    rows: list[dict] = []
    report: dict = {"benchmark": "offload", **choice.record(), "dtype": "bfloat16", "new_tokens": new_tokens,
                    "rows": rows, "h2d_gb_s": _h2d_gb_s(device)}
    console.print(f"pinned host-to-device copies: {report['h2d_gb_s']:.1f} GB/s")
    tokenizer = embedded_tokenizer()
    prompt = decode_rows(tokenizer, PROMPT_TOKENS, 1)[0]
    long_prompt = decode_rows(tokenizer, LONG_PROMPT_TOKENS, 1)[0]
    report["prompt_tokens"] = len(prompt)
    budgets: dict[str, int] = {}

    def model_on_device() -> torch.nn.Module:  # random init on the device is seconds; on the host, minutes
        return build_shape_model(choice.shape, device, torch.bfloat16, tokenizer=tokenizer)[0]

    def int4_on_device(kernel: str | None = None) -> torch.nn.Module:
        return build_int4_shape_model(choice.shape, device, torch.bfloat16, tokenizer, kernel)[0]

    def in_host_memory(model: torch.nn.Module) -> torch.nn.Module:
        model.cpu()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)  # the row's peak starts here, not at the build's
        return model

    def ttft_ms(engine, ids: list[int]) -> float:  # the second run: the first pays one-off captures
        engine.generate(input_ids=ids, max_new_tokens=1)
        engine.forget_workspace()
        return engine.generate(input_ids=ids, max_new_tokens=1, mode="baseline").ttft_ms

    def engine_row(make: Callable[[], tuple[torch.nn.Module, int | None]], depth: int | None = None,
                   fast_path: str = "auto", draft: Callable[[], torch.nn.Module] | None = None) -> Callable[[], tuple]:
        def build():
            model, budget = make()
            torch.cuda.reset_peak_memory_stats(device)
            spec = {"speculative": "draft", "draft_model": draft()} if draft is not None else {}
            engine = KVBoost(model, tokenizer, device=str(device), weight_budget_bytes=budget,
                             weight_prefetch_depth=depth, fast_path=fast_path, **spec)
            weights = engine.cache_stats()["weights"]
            streamed = sum(_module_bytes(model.model.layers[i]) for i in weights["streamed_layers"])
            extra = {"weight_mb": _module_bytes(model) / 2**20, "budget_mb": budget / 2**20 if budget else None,
                     "streamed_layers": len(weights["streamed_layers"]), "streamed_mb_per_step": streamed / 2**20,
                     "fast_path": engine.cache_stats()["fast_path"].get("mode"),
                     "ttft_1k_ms": ttft_ms(engine, prompt), "ttft_8k_ms": ttft_ms(engine, long_prompt)}
            if streamed:
                extra["bound_tok_s"] = report["h2d_gb_s"] * 1e9 / streamed

            def call(k: int) -> int:
                n = engine.generate(input_ids=prompt, max_new_tokens=k).generated_tokens
                if draft is not None:  # tau: tokens per target pass (each verify keeps its accepted drafts + 1)
                    sp = engine.cache_stats()["speculative"]
                    tau = 1 + sp["accepted_tokens"] / sp["proposals"] if sp.get("proposals") else 1.0
                    extra.update(tokens_per_pass=tau, proposals=sp.get("proposals", 0))
                    if streamed:
                        extra["bound_with_tau_tok_s"] = extra["bound_tok_s"] * tau
                return n
            return call, extra
        return build

    def streamed(share: float, slots: int = 2):
        def make():
            model = in_host_memory(int4_on_device())
            resident = int(len(model.model.layers) * share)
            budgets[f"{share}"] = _budget(model, resident, slots)
            return model, budgets[f"{share}"]
        return make

    plan = [("bf16", engine_row(lambda: (model_on_device(), None))),
            ("int4 triton", engine_row(lambda: (int4_on_device("triton"), None))),
            ("int4 tinygemm", engine_row(lambda: (int4_on_device("tinygemm"), None))),
            ("int4 streamed 1/2", engine_row(streamed(0.5))),
            ("int4 streamed 1/2, graphs", engine_row(streamed(0.5), fast_path="graphs")),
            ("int4 streamed all", engine_row(streamed(0.0))),
            ("int4 streamed all, graphs", engine_row(streamed(0.0), fast_path="graphs"))]

    def fraction(share: float):  # a budget of `share` of the packed model's bytes
        def make():
            model = in_host_memory(int4_on_device())
            return model, int(share * _module_bytes(model))
        return make

    plan += [(f"int4 streamed, {p}% budget", engine_row(fraction(p / 100))) for p in (25, 50)]
    if draft_shape:  # a resident draft proposing for the streamed target (random weights: tau says little)
        plan.append((f"int4 streamed all + {draft_shape} draft", engine_row(
            streamed(0.0), draft=lambda: build_shape_model(draft_shape, device, torch.bfloat16,
                                                           tokenizer=tokenizer)[0])))
    # The prefetch depth (device slots for streamed layers) by measurement: every layer streams, `d` slots.
    plan += [(f"int4 streamed all, depth {d}", engine_row(streamed(0.0, d), d)) for d in depths]
    if budget_gb is not None:  # a device budget as a user gives it (e.g. 12 GB for a 32B model)
        plan.append((f"int4 streamed, {budget_gb:g} GB budget", engine_row(
            lambda: (in_host_memory(int4_on_device()), int(budget_gb * 2**30)))))
    def add(row: dict) -> None:
        rows.append(row)
        if json_path:  # after every row: a run cut short keeps what it measured
            write_json(json_path, report)

    with console.status("offload rows"):
        for name, build in plan:
            add(_row(name, build, device, new_tokens, console))
        if "0.5" in budgets:
            add(_row("hf device_map auto", lambda: _hf_offload(in_host_memory(model_on_device()), budgets["0.5"],
                                                               device, prompt), device, min(new_tokens, 8), console))
    ok = {r["system"]: r for r in rows if r.get("status") == "ok"}
    if "bf16" in ok:
        for r in ok.values():
            r["over_bf16"] = r["decode_tok_s"] / ok["bf16"]["decode_tok_s"]
    save_tok_s(console, {**report, "rows": list(ok.values())}, None, plot_path,
               f"Decode, batch 1, {len(prompt)}-token prompt ({choice.shape}, {torch.cuda.get_device_name(device)})")
    if json_path:
        write_json(json_path, report)
        console.print(f"wrote {json_path}")
    return report


def _hf_offload(model: torch.nn.Module, budget: int, device: torch.device, prompt: list[int]) -> tuple:
    """transformers' generate over accelerate's offloading: the layers that do not fit `budget` bytes of the device
    live in host memory and are copied in by hooks at every forward."""
    from accelerate import dispatch_model, infer_auto_device_map

    index = device.index if device.index is not None else torch.cuda.current_device()
    device_map = infer_auto_device_map(model, max_memory={index: budget, "cpu": 2**40},
                                       no_split_module_classes=[type(model.model.layers[0]).__name__])
    model = dispatch_model(model, device_map=device_map)
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.tensor([prompt], device=device)
    offloaded = sum(1 for where in device_map.values() if where == "cpu")

    def call(k: int) -> int:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, do_sample=False)
        return out.shape[1] - ids.shape[1]
    return call, {"budget_mb": budget / 2**20, "offloaded_modules": offloaded}
