"""One PNG for `kvboost bench gpu`: one panel per section (matplotlib imported here only, no pyplot)."""
from __future__ import annotations

import math
import textwrap
from pathlib import Path


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _fidelity(ax, section: dict) -> None:
    """Per model and dtype, the questions identical to HF generate for each system, against the question count."""
    rows = section.get("rows", [])
    labels = [f"{r['model']}\n{r['dtype']}" for r in rows]
    xs = range(len(rows))
    ax.bar(xs, [r["questions"] for r in rows], width=0.8, color="none", edgecolor="gray", linestyle="--",
           label="questions")
    for i, (key, label) in enumerate((("kvboost_identical", "KVBoost"), ("recipe_identical", "HF prefix recipe"))):
        heights = [r[key] for r in rows]
        bars = ax.bar([x + (i - 0.5) * 0.38 for x in xs], heights, width=0.38, label=label)
        ax.bar_label(bars, [f"{h}/{r['questions']}" for h, r in zip(heights, rows)], fontsize="x-small")
    ax.set_xticks(list(xs), labels, fontsize="small")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_ylim(0, max([r["questions"] for r in rows], default=1) * 1.35)  # room for the legend above the bars
    ax.set(title=f"fidelity: identical to HF generate ({section.get('new_tokens', '?')} tokens)",
           ylabel="questions")


def _chat(ax, section: dict) -> None:
    rows = section.get("per_turn", [])
    for name, label in (("plain", "plain (full prefill)"), ("manual", "manual DynamicCache"), ("kvboost", "KVBoost")):
        pts = [(r["turn"], r[f"{name}_p50_ms"]) for r in rows if _finite(r[f"{name}_p50_ms"])]
        if pts:
            ax.plot(*zip(*pts), marker="o", markersize=3, label=label)
    ax.set(title="a. chat-turn TTFT p50", xlabel="turn", ylabel="ms")


def _prefix(ax, section: dict) -> None:
    rows = section.get("rows", [])
    for key, label in (("full_ms", "full prefill"), ("floor_ms", "suffix-only floor"), ("kvboost_ms", "KVBoost")):
        pts = [(r["prefix_tokens"], r[key]) for r in rows if _finite(r[key])]
        if pts:
            ax.plot(*zip(*pts), marker="o", markersize=3, label=label)
    if rows:
        ax.set_xscale("log")
    ax.set(title="b. TTFT over a cached prefix", xlabel="prefix tokens", ylabel="ms")


def _decode(ax, section: dict) -> None:
    rows = [r for r in section.get("rows", []) if r.get("status") == "ok" and _finite(r.get("decode_tok_s"))]
    systems = list(dict.fromkeys(r["system"] for r in rows))
    batches = sorted({r["batch"] for r in rows})
    width = 0.8 / max(1, len(systems))
    for i, system in enumerate(systems):
        by_batch = {r["batch"]: r["decode_tok_s"] for r in rows if r["system"] == system}
        xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(batches))]
        ax.bar(xs, [by_batch.get(b, 0.0) for b in batches], width=width, label=system)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set(title="c. decode tokens/s", ylabel="tokens/s")


def _kernels(ax, section: dict) -> None:
    """The kernel module's rows (median ms per shape and implementation) when it ran; else the SDPA reference."""
    kernel = section.get("kernel") or {}
    rows = [r for r in kernel.get("rows", []) if _finite(r.get("median_ms"))]
    if rows:
        shapes = list(dict.fromkeys(r["shape"] for r in rows))
        impls = list(dict.fromkeys(r["impl"] for r in rows))
        height = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            by_shape = {r["shape"]: r["median_ms"] for r in rows if r["impl"] == impl}
            ys = [j + (i - (len(impls) - 1) / 2) * height for j in range(len(shapes))]
            ax.barh(ys, [by_shape.get(sh, 0.0) for sh in shapes], height=height, label=impl)
        ax.set_yticks(range(len(shapes)), shapes, fontsize="x-small")
        ax.set_xscale("log")
        ax.set(title="d. attention kernels vs torch SDPA, median per call", xlabel="ms (log)")
        return
    rows = [r for r in section.get("sdpa", []) if r.get("status") == "ok"]
    ys = range(len(rows))
    ax.barh([y - 0.2 for y in ys], [r["steady_ms"] for r in rows], height=0.4, label="steady")
    ax.barh([y + 0.2 for y in ys], [r["first_call_ms"] for r in rows], height=0.4, label="first call, new shape")
    ax.set_yticks(list(ys), [textwrap.fill(r["case"], 30) for r in rows], fontsize="x-small")
    ax.set_xscale("log")
    ax.set(title=f"d. torch SDPA per call (kernels: {kernel.get('status', 'not run')})", xlabel="ms (log)")


def plot_gpu_report(report: dict, path: str | Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(19, 9), dpi=100, layout="constrained")
    axes = fig.subplots(2, 3)
    axes.flat[-1].set_axis_off()  # five sections, six cells
    sections = report.get("sections", {})
    for ax, (name, draw) in zip(axes.flat, (("fidelity", _fidelity), ("chat", _chat), ("prefix", _prefix),
                                            ("decode", _decode), ("kernels", _kernels))):
        if name in sections:
            draw(ax, sections[name])
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize="small")
        else:
            ax.set_title(f"{name}: not run")
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"kvboost bench gpu: {report['model']}, {report['device']}, {report['dtype']}")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
