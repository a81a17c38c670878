"""`kvboost bench quant`: bytes per cached token and fidelity of KIVI int8/int4 against 16-bit storage.

Every prompt is a chat whose system prompt was warmed; the answer is generated over K/V loaded from
the store (the resident workspace is forgotten first, so the quantized copy is what gets used) and
compared with the same generation over full-precision K/V.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from .console import bench_console
from .model_options import (
    QUALITY_REFUSAL,
    DeviceOption,
    DtypeOption,
    ModelChoice,
    ModelOption,
    ShapeOption,
    as_choice,
    model_choice,
)


@dataclass
class QuantRow:
    bits: int
    bytes_per_token: float
    ratio_to_fp16: float  # stored bytes / bytes the same K/V would take as fp16
    first_token_agreement: float
    mean_kl: float
    greedy_match: float  # share of prompts whose greedy continuation is identical
    prompts: int


def _prompts(limit: int) -> list[tuple[list[dict], list[dict]]]:
    from .workloads import load_conversations, load_system_prompt

    system, questions = load_system_prompt()
    out = [([{"role": "system", "content": system}], [{"role": "user", "content": q["question"]}])
           for q in questions]
    for conv in load_conversations():
        out.append(([{"role": "system", "content": conv["system"]}], [{"role": "user", "content": conv["turns"][0]}]))
    return out[:limit]


def run_quant_bench(model: str | ModelChoice | None, n_prompts: int, new_tokens: int, json_path: str | None,
                    plot_path: str | None) -> list[QuantRow]:
    import torch

    from kvboost import KVBoost

    from .model_options import load_engine
    from .plots import plot_bars, write_json

    choice = as_choice(model)
    console = bench_console()
    with console.status("loading model"):
        reference = load_engine(choice)
    engines = {16: reference}
    for bits in (8, 4):
        engines[bits] = KVBoost(reference.model, reference.tokenizer, kv_cache_bits=bits)
    prompts = _prompts(n_prompts)
    outputs: dict[int, list] = {b: [] for b in engines}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("quant bench", total=len(prompts) * len(engines))
        for system, user in prompts:
            for bits, engine in engines.items():
                engine.warm(messages=system)
                engine.forget_workspace()
                r = engine.generate(messages=system + user, max_new_tokens=new_tokens, return_logits=True)
                outputs[bits].append(r)
                progress.advance(task)
    rows = []
    for bits, engine in engines.items():
        mem = engine.cache_stats()["tiers"]["memory"]
        tokens = sum(len(m.token_ids) for m in _all_meta(engine))
        agree, kls, same = 0, [], 0
        for ref, res in zip(outputs[16], outputs[bits]):
            a, b = ref.first_token_logits, res.first_token_logits
            agree += int(a.argmax()) == int(b.argmax())
            kls.append(torch.nn.functional.kl_div(torch.log_softmax(b, -1), torch.log_softmax(a, -1),
                                                  log_target=True, reduction="sum").clamp_min(0).item())
            same += ref.output_token_ids == res.output_token_ids
        n = len(outputs[bits])
        rows.append(QuantRow(bits, mem["bytes"] / max(tokens, 1), 0.0, agree / n, sum(kls) / n, same / n, n))
    # The 16-bit engine stores the model's own dtype (fp32 on CPU); fp16 would take 2 bytes per element.
    fp16_bytes_per_token = rows[0].bytes_per_token / reference.kv_dtype.itemsize * 2
    for row in rows:
        row.ratio_to_fp16 = row.bytes_per_token / fp16_bytes_per_token
    _print(console, rows, fp16_bytes_per_token)
    if json_path:
        write_json(json_path, {"benchmark": "quant", **choice.record(reference),
                               "fp16_bytes_per_token": fp16_bytes_per_token, "new_tokens": new_tokens,
                               "rows": [asdict(r) for r in rows]})
        console.print(f"wrote {json_path}")
    if plot_path:
        plot_bars({f"{r.bits}-bit": {"bytes vs fp16": r.ratio_to_fp16, "first-token agreement":
                                     r.first_token_agreement, "greedy match": r.greedy_match} for r in rows},
                  "KV storage: size and fidelity", "stored precision", "ratio", plot_path)
        console.print(f"wrote {plot_path}")
    return rows


def _all_meta(engine):
    memory = engine.store.memory if hasattr(engine.store, "memory") else engine.store
    return memory.metas()


def _print(console: Console, rows: list[QuantRow], fp16_bpt: float) -> None:
    table = Table(title=f"KV storage precision (fp16 would take {fp16_bpt:,.0f} bytes/token)")
    for col in ("bits", "bytes/token", "vs fp16", "first-token agree", "mean KL", "greedy match", "prompts"):
        table.add_column(col, justify="right")
    for r in rows:
        label = str(r.bits) if r.bits < 16 else "unquantized"
        table.add_row(label, f"{r.bytes_per_token:,.0f}", f"{r.ratio_to_fp16:.3f}x",
                      f"{r.first_token_agreement:.1%}", f"{r.mean_kl:.2e}", f"{r.greedy_match:.1%}", str(r.prompts))
    console.print(table)


def bench_quant_command(
    model: ModelOption = None, shape: ShapeOption = None, device: DeviceOption = None, dtype: DtypeOption = None,
    prompts: int = typer.Option(109, min=1, help="Chat prompts (system prompt warmed, first user turn)."),
    new_tokens: int = typer.Option(16, min=1, help="Greedy tokens compared per prompt."),
    json_path: str | None = typer.Option(None, "--json", help="Write results as JSON."),
    plot_path: str | None = typer.Option(None, "--plot", help="Write a PNG plot."),
) -> None:
    """Bytes per cached token and fidelity of int8 / int4 KV storage against 16-bit (refuses --shape)."""
    choice = model_choice(model, shape, device, dtype, refuse_shape=QUALITY_REFUSAL.format(command="bench quant"))
    run_quant_bench(choice, prompts, new_tokens, json_path, plot_path)
