"""The tables of `kvboost bench gpu`, rendered from its report dict: live while it runs, and at the end."""
from __future__ import annotations

import math
from typing import Any

from rich.console import Group, RenderableType
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

from ..plots import render_table


def _ms(v: Any, digits: int = 1) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:,.{digits}f}"


def _status(section: dict) -> str:
    reason = section.get("reason")
    return f"{section.get('status', '?')}" + (f" ({reason})" if reason else "")


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def steps_cell(steps: dict | None) -> str:
    """One system's fp32 step summary: share of steps at the fp32 argmax, and the off-argmax steps (how many
    within NEAR_TIE_NATS, the largest deficit)."""
    if not steps:
        return "-"
    off = steps["off_argmax"]
    cell = _share(steps["fp32_argmax"], steps["steps"])
    if off:
        cell += f" ({steps['off_argmax_near_tie']}/{off} near, max {_ms(steps['deficit']['max'], 2)})"
    return cell


def duels_cell(steps: dict | None) -> str:
    """Where a system first left the reference: duels the fp32 model gave it / the reference, and near-ties."""
    duels = (steps or {}).get("duels")
    if not duels:
        return "-"
    return f"{duels['won']}-{duels['lost']} ({duels['near_tie']} near)"


def fidelity_table(section: dict) -> RenderableType:
    n, prefix = section.get("new_tokens", "?"), section.get("prefix_tokens", "?")
    table = Table(title=f"fidelity: questions whose {n} greedy tokens equal HF generate's, after a {prefix}-token "
                        f"stored prefix [{_status(section)}]",
                  caption="recipe = HF's manual prefix cache (prefix DynamicCache, deep-copied into generate); "
                          "div = mean first differing step of the questions that differ; cut before EOS. "
                          "fp32 argmax = steps whose token is an fp32 copy's argmax, teacher-forced (near = off the "
                          "argmax by <= 0.1 nats, max = largest deficit, nats); duels = where KVBoost first left "
                          "HF generate, fp32 preferred KVBoost-HF (near = margin <= 0.1 nats)")
    for col in ("model", "dtype", "KVBoost", "recipe", "KVB = recipe", "KVB div", "recipe div", "KVB cached",
                "HF fp32 argmax", "KVB fp32 argmax", "KVB duels", "attention"):
        table.add_column(col, justify="left" if col in ("model", "dtype", "attention") else "right")
    for r in section.get("rows", []):
        q, steps = r["questions"], r.get("fp32_steps", {})
        table.add_row(r["model"], r["dtype"], f"{r['kvboost_identical']}/{q}", f"{r['recipe_identical']}/{q}",
                      f"{r['kvboost_equals_recipe']}/{q}", _ms(r.get("kvboost_first_divergence_mean")),
                      _ms(r.get("recipe_first_divergence_mean")), _ms(r.get("kvboost_cached_mean"), 0),
                      steps_cell(steps.get("reference")), steps_cell(steps.get("kvboost")),
                      duels_cell(steps.get("kvboost")), str(r.get("attention", "")))
    for dtype, t in section.get("totals", {}).items():
        q, steps = t["questions"], t.get("fp32_steps", {})
        table.add_row("all", dtype, f"{t['kvboost_identical']}/{q}", f"{t['recipe_identical']}/{q}",
                      f"{t['kvboost_equals_recipe']}/{q}", "", "", "", steps_cell(steps.get("reference")),
                      steps_cell(steps.get("kvboost")), duels_cell(steps.get("kvboost")), "", style="bold")
    return table


def chat_table(section: dict) -> RenderableType:
    table = Table(title=f"a. chat-turn TTFT, ms: p50 / p99 over conversations [{_status(section)}]",
                  caption="plain = full prefill each turn; manual = previous turn's DynamicCache cropped + rest; "
                          "spike = slowest turn / median turn")
    for col in ("turn", "n", "prompt tok", "plain", "manual", "KVBoost", "KVB cached"):
        table.add_column(col, justify="right")
    for r in section.get("per_turn", []):
        table.add_row(str(r["turn"]), str(r["n"]), f"{r['prompt_tokens']:.0f}",
                      *(f"{_ms(r[f'{s}_p50_ms'])} / {_ms(r[f'{s}_p99_ms'])}" for s in ("plain", "manual", "kvboost")),
                      f"{r['kvboost_cached']:.0f}")
    spike = section.get("spike") or {}
    if spike:
        table.add_row("spike", "", "", *(f"{_ms(spike[s]['max_over_median'], 2)}x" for s in
                                         ("plain", "manual", "kvboost")), "")
    return table


def prefix_table(section: dict) -> RenderableType:
    table = Table(title=f"b. TTFT over a cached prefix, median ms [{_status(section)}]",
                  caption="floor = prefill of the same uncached suffix over a DynamicCache already holding the "
                          "prefix (timed on the same shape's second run: no cuDNN plan build); full = no cache; "
                          "store = workspace forgotten, chunks copied from the store's device tier; host = every "
                          "stored chunk in the host tier (device_kv_budget_bytes=0)"
                          + (f"; {section['note']}" if section.get("note") else ""))
    for col in ("prefix", "suffix tok", "full", "floor", "KVBoost", "KVB/floor", "store/floor", "host/floor"):
        table.add_column(col, justify="right")
    for r in section.get("rows", []):
        tiers = [_ms(r.get(f"{name}_over_floor"), 2) if f"{name}_over_floor" in r else
                 ("error" if f"{name}_error" in r else "-") for name in ("store", "host")]
        table.add_row(f"{r['prefix_tokens']:,}", str(r["suffix_tokens"]), _ms(r["full_ms"]), _ms(r["floor_ms"]),
                      _ms(r["kvboost_ms"]), _ms(r["kvboost_over_floor"], 2), *tiers)
    return table


def decode_table(section: dict) -> RenderableType:
    table = Table(title=f"c. decode tokens/s, {section.get('prompt_tokens', '?')}-token prompts, "
                        f"{section.get('decode_tokens', '?')} new tokens [{_status(section)}]")
    for col in ("system", "batch", "tok/s", "ms/step", "compile s", "note"):
        table.add_column(col, justify="left" if col in ("system", "note") else "right")
    for r in section.get("rows", []):
        rate = r.get("decode_tok_s")
        per_step = (r["batch"] * 1e3 / rate) if rate and math.isfinite(rate) and rate > 0 else None
        table.add_row(r["system"], str(r["batch"]), _ms(rate), _ms(per_step, 2), _ms(r.get("compile_s")),
                      r.get("reason", "") if r.get("status") != "ok" else "")
    return table


def kernel_tables(section: dict) -> list[RenderableType]:
    out: list[RenderableType] = []
    sdpa = section.get("sdpa") or []
    if sdpa:
        rows = [{"case": r["case"], "first call ms": r.get("first_call_ms"), "steady ms": r.get("steady_ms"),
                 "note": r.get("reason", "")} for r in sdpa]
        out.append(render_table(rows, title=f"d. torch SDPA reference [{_status(section)}]"))
    kernel = section.get("kernel")
    if kernel:
        if kernel.get("rows"):
            headers = {"shape": "shape", "impl": "impl", "first_call_ms": "first call ms", "median_ms": "median ms",
                       "spike": "first/median", "speedup_vs_sdpa_lower_right": "x vs SDPA lower-right",
                       "max_abs_diff": "max |diff|", "error": "error"}
            columns = [(k, h) for k, h in headers.items() if any(k in r for r in kernel["rows"])]
            out.append(render_table(kernel["rows"], columns or None,
                                    title="d. KVBoost attention kernels vs torch SDPA (ms per call)"))
        else:
            out.append(Text(f"d. KVBoost attention kernels: {kernel['status']}: {kernel.get('reason', '')}"))
    return out


def report_view(report: dict) -> RenderableType:
    parts: list[RenderableType] = [Text(f"kvboost bench gpu: {report['model']} on {report['device']}, "
                                        f"{report['dtype']}", style="bold")]
    sections = report.get("sections", {})
    if "fidelity" in sections:
        parts.append(fidelity_table(sections["fidelity"]))
    if "chat" in sections:
        parts.append(chat_table(sections["chat"]))
    if "prefix" in sections:
        parts.append(prefix_table(sections["prefix"]))
    if "decode" in sections:
        parts.append(decode_table(sections["decode"]))
    if "kernels" in sections:
        parts.extend(kernel_tables(sections["kernels"]))
    return Group(*parts)


class LiveView:
    """What rich.Live redraws: the progress bars above the tables of whatever has been measured so far."""

    def __init__(self, report: dict, progress: Progress):
        self.report, self.progress = report, progress

    def __rich__(self) -> RenderableType:
        return Group(self.progress, report_view(self.report))


def targets_line(report: dict) -> str:
    """What this run measured beside the issue's targets (which are for the qwen2.5-3b shape, bf16, one H100)."""
    m, t = report.get("measured", {}), report.get("targets", {})

    def f(key: str, digits: int = 1) -> str:
        return _ms(m.get(key), digits)

    longest = m.get("prefix_longest_tokens")
    return (f"targets (H100, qwen2.5-3b, bf16) vs this run: chat KVBoost p50 from turn 2 "
            f"{f('chat_kvboost_p50_ms_from_turn2')} ms (<= {t.get('chat_kvboost_p50_ms_from_turn2')}), p99/p50 "
            f"{f('chat_p99_over_p50', 2)} (<= {t.get('chat_p99_over_p50')}); decode batch 1 "
            f"{f('decode_batch1_tok_s')} tok/s (>= {t.get('decode_batch1_tok_s')}); KVBoost/floor at "
            f"{longest if longest else '-'} prefix tokens {f('prefix_longest_over_floor', 2)} "
            f"(<= {t.get('prefix_30k_over_floor')} at 30k); identical to HF generate: fp32 KVBoost "
            f"{m.get('fidelity_fp32_kvboost', '-')} (all), bf16 KVBoost {m.get('fidelity_bf16_kvboost', '-')} "
            f"(>= recipe {m.get('fidelity_bf16_recipe', '-')})")
