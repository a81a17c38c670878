"""Output helpers shared by every benchmark: PNG charts, rich tables and JSON files.

matplotlib is imported inside the plotting functions (it is an optional ``bench`` extra and slow to
import), and only its object-oriented ``Figure`` API is used: no pyplot means no global backend switch,
no figure registry to leak memory in long sweeps, and it works headless without ``MPLBACKEND=Agg``.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

Point = tuple[float, float]


def _new_figure(width: float = 7.0, height: float = 4.5) -> Any:
    from matplotlib.figure import Figure  # lazy: see module docstring

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _finish(fig: Any, ax: Any, title: str, xlabel: str, ylabel: str, path: str | Path, legend: bool) -> Path:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if legend:
        ax.legend(fontsize="small")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def plot_lines(series: Mapping[str, Sequence[Point]], title: str, xlabel: str, ylabel: str, path: str | Path, *,
               logx: bool = False, logy: bool = False) -> Path:
    """One line per series name, points sorted by x (e.g. TTFT vs prompt length per mode). Returns ``path``."""
    if not series or not any(series.values()):
        raise ValueError("plot_lines: no points to plot")
    fig = _new_figure()
    ax = fig.add_subplot()
    for name, pts in series.items():
        if pts:
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, marker="o", markersize=3, label=str(name))
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    return _finish(fig, ax, title, xlabel, ylabel, path, legend=True)


def plot_scatter(points: Sequence[Mapping[str, Any]], title: str, xlabel: str, ylabel: str, path: str | Path, *,
                 annotate: bool = True) -> Path:
    """Points are ``{"label", "x", "y"}`` dicts (e.g. one per system: memory vs speedup). Returns ``path``.

    Points sharing a label share a colour and one legend entry; ``annotate`` also writes the label next to
    each point, which reads better than a legend when there are only a handful of systems.
    """
    if not points:
        raise ValueError("plot_scatter: no points to plot")
    fig = _new_figure()
    ax = fig.add_subplot()
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for p in points:
        missing = {"label", "x", "y"} - set(p)
        if missing:
            raise ValueError(f"plot_scatter: point {dict(p)!r} lacks {sorted(missing)}")
        groups.setdefault(str(p["label"]), []).append(p)
    for label, pts in groups.items():
        ax.scatter([p["x"] for p in pts], [p["y"] for p in pts], label=label, s=30)
        if annotate:
            for p in pts:
                ax.annotate(label, (p["x"], p["y"]), textcoords="offset points", xytext=(4, 4), fontsize="small")
    return _finish(fig, ax, title, xlabel, ylabel, path, legend=len(groups) > 1)


def _bar_label(v: float) -> str:
    # "%.3g" would write 3,000 ms as "3e+03".
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def plot_bars(bars: Mapping[str, float] | Mapping[str, Mapping[str, float]], title: str, xlabel: str, ylabel: str,
              path: str | Path, *, annotate: bool = True) -> Path:
    """Bar chart. ``{"chat": 1.8, "rag": 3.1}`` gives simple bars; nested mappings such as
    ``{"chat": {"baseline": 120, "kvboost": 40}, ...}`` give grouped bars, one colour per inner key.
    Returns ``path``."""
    if not bars:
        raise ValueError("plot_bars: no bars to plot")
    categories = [str(c) for c in bars]
    values = list(bars.values())
    grouped = all(isinstance(v, Mapping) for v in values)
    if not grouped and any(isinstance(v, Mapping) for v in values):
        raise ValueError("plot_bars: mix of plain and grouped values")
    table: dict[str, list[float]]
    if grouped:
        names = list(dict.fromkeys(k for v in values for k in v))  # stable union of series names
        table = {n: [float(v.get(n, math.nan)) for v in values] for n in names}
    else:
        table = {"": [float(v) for v in values]}
    fig = _new_figure(width=max(6.0, 0.9 * len(categories) * max(1, len(table)) + 2))
    ax = fig.add_subplot()
    width = 0.8 / len(table)
    for i, (name, ys) in enumerate(table.items()):
        xs = [c + (i - (len(table) - 1) / 2) * width for c in range(len(categories))]
        rects = ax.bar(xs, ys, width=width, label=name or None)
        if annotate:
            ax.bar_label(rects, fmt=_bar_label, fontsize="x-small", padding=2)
    # Long names would run into each other: slanted, anchored at their ends under their bars.
    slanted = max(len(c) for c in categories) * len(categories) > 70
    ax.set_xticks(range(len(categories)), categories, rotation=20 if slanted else 0,
                  ha="right" if slanted else "center")
    return _finish(fig, ax, title, xlabel, ylabel, path, legend=grouped)


# --------------------------------------------------------------------------------------------- tables

def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:,.2f}" if abs(v) >= 1 or v == 0 else f"{v:.3g}"
    return str(v)


def render_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str | tuple[str, str]] | None = None,
                 title: str | None = None) -> Table:
    """A rich Table from dict rows. ``columns`` lists keys or ``(key, header)`` pairs; by default every key
    seen, in first-seen order. Numbers are right-aligned and formatted compactly; missing cells show '-'."""
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    cols = [(c, c) if isinstance(c, str) else (c[0], c[1]) for c in columns]
    table = Table(title=title)
    for key, header in cols:
        numeric = any(isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) for r in rows)
        table.add_column(header, justify="right" if numeric else "left")
    for r in rows:
        table.add_row(*(_fmt(r.get(key)) for key, _ in cols))
    return table


# ----------------------------------------------------------------------------------------------- JSON

def _jsonable(obj: Any) -> Any:
    # Non-finite floats become null: NaN/Infinity are not JSON and break browsers reading the results.
    if isinstance(obj, enum.Enum):  # before str/int: str- and int-enums must serialize as their value
        return _jsonable(obj.value)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(dataclasses.asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((_jsonable(v) for v in obj), key=repr)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    # numpy / torch scalars and arrays, without importing either library.
    for attr in ("tolist", "item"):
        if callable(getattr(obj, attr, None)):
            return _jsonable(getattr(obj, attr)())
    raise TypeError(f"write_json: cannot serialize {type(obj).__name__}")


def machine_info() -> dict[str, Any]:
    """Where a result was measured: figures are only comparable on the same machine and thread count."""
    import platform

    import torch

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count()
    info: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), "usable_cpus": usable,
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": _version("transformers"),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    if torch.cuda.is_available():  # GPU figures compare only on the same GPU, driver stack and library versions
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": props.name, "count": torch.cuda.device_count(),
                       "memory_gb": round(props.total_memory / 2**30, 1),
                       "capability": f"{props.major}.{props.minor}", "cuda_runtime": torch.version.cuda,
                       "cudnn": torch.backends.cudnn.version(), "triton": _version("triton")}
    return info


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON (dataclasses, enums, paths and numpy/torch scalars allowed).

    The write is atomic (temp file + rename) so an interrupted benchmark never leaves a truncated file that a
    later ``kvboost cost --from-bench`` would choke on. Returns the path written.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(obj, dict) and "machine" not in obj:
        obj = {**obj, "machine": machine_info()}
    text = json.dumps(_jsonable(obj), indent=2, ensure_ascii=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; results are meant to be shared
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def save_tok_s(console: Any, report: dict, json_path: str | None, plot_path: str | None, title: str) -> None:
    """The report as JSON and a bar plot of its rows' decode tok/s (by "system"), each where asked, saying so."""
    if json_path:
        write_json(json_path, report)
        console.print(f"wrote {json_path}")
    if plot_path:
        plot_bars({r["system"]: r["decode_tok_s"] for r in report["rows"]}, title, "", "tokens/s", plot_path)
        console.print(f"wrote {plot_path}")
