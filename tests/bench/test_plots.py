"""Plot, table and JSON helpers shared by the benchmarks."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import pytest
from rich.console import Console

from benchmarks.plots import plot_bars, plot_lines, plot_scatter, render_table, write_json  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path: Path) -> bool:
    data = path.read_bytes()
    return data.startswith(PNG_MAGIC) and len(data) > 2000


def test_plot_lines(tmp_path):
    out = tmp_path / "nested" / "ttft.png"
    series = {"baseline": [(4000, 310.0), (1000, 80.0), (2000, 160.0)], "kvboost": [(1000, 20.0), (4000, 25.0)]}
    assert plot_lines(series, "TTFT vs prefix", "prefix tokens", "ms", out) == out
    assert _is_png(out)
    assert _is_png(plot_lines(series, "log", "x", "y", tmp_path / "log.png", logx=True, logy=True))


def test_plot_scatter(tmp_path):
    pts = [{"label": "kvboost", "x": 1.2, "y": 3.4}, {"label": "vllm", "x": 2.0, "y": 2.1},
           {"label": "kvboost", "x": 1.5, "y": 3.0}]
    out = plot_scatter(pts, "memory vs speedup", "GiB", "x", str(tmp_path / "s.png"))
    assert out == tmp_path / "s.png" and _is_png(out)


def test_plot_bars_simple_and_grouped(tmp_path):
    assert _is_png(plot_bars({"chat": 1.8, "rag": 3.1, "system": 5.0}, "speedup", "workload", "x",
                             tmp_path / "b.png"))
    grouped = {"chat": {"baseline": 120.0, "kvboost": 40.0}, "rag": {"baseline": 300.0, "kvboost": 90.0},
               "agents": {"baseline": 210.0}}  # a missing inner key is simply not drawn
    assert _is_png(plot_bars(grouped, "TTFT", "workload", "ms", tmp_path / "g.png"))


@pytest.mark.parametrize("call", [
    lambda p: plot_lines({}, "t", "x", "y", p),
    lambda p: plot_lines({"a": []}, "t", "x", "y", p),
    lambda p: plot_scatter([], "t", "x", "y", p),
    lambda p: plot_scatter([{"label": "a", "x": 1}], "t", "x", "y", p),
    lambda p: plot_bars({}, "t", "x", "y", p),
    lambda p: plot_bars({"a": 1.0, "b": {"c": 2.0}}, "t", "x", "y", p),
])
def test_plot_input_errors(tmp_path, call):
    with pytest.raises(ValueError):
        call(tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def _render(table) -> str:
    console = Console(record=True, width=160)
    console.print(table)
    return console.export_text()


def test_render_table_columns_and_formatting():
    rows = [{"mode": "baseline", "ttft_ms": 312.456, "tokens": 4000, "reuse": 0.0, "ok": True},
            {"mode": "kvboost", "ttft_ms": 24.5, "tokens": 4000, "reuse": 0.8612, "ok": False, "extra": None}]
    table = render_table(rows, ["mode", ("ttft_ms", "TTFT (ms)"), "tokens", "reuse", "ok"], title="prefix bench")
    assert [c.header for c in table.columns] == ["mode", "TTFT (ms)", "tokens", "reuse", "ok"]
    assert table.row_count == 2 and table.columns[1].justify == "right" and table.columns[0].justify == "left"
    text = _render(table)
    for s in ("prefix bench", "312.46", "4,000", "0.861", "yes", "no"):
        assert s in text
    auto = render_table(rows)  # every key, first-seen order; missing cells render as "-"
    assert [c.header for c in auto.columns][-1] == "extra" and list(auto.columns[-1].cells) == ["-", "-"]


class Mode(str, Enum):
    BASELINE = "baseline"


@dataclass
class Result:
    mode: Mode
    ttft_ms: float
    out: Path


class FakeScalar:  # stands in for numpy/torch scalars without importing them
    def item(self):
        return 7


def test_write_json_handles_benchmark_types(tmp_path):
    obj = {"results": [Result(Mode.BASELINE, 1.5, Path("a/b.png"))], "nan": math.nan, "inf": -math.inf,
           "tags": {"b", "a"}, "n": FakeScalar(), "t": (1, 2)}
    out = write_json(tmp_path / "deep" / "r.json", obj)
    assert out == tmp_path / "deep" / "r.json"
    data = json.loads(out.read_text())
    assert data["results"] == [{"mode": "baseline", "ttft_ms": 1.5, "out": "a/b.png"}]
    assert data["nan"] is None and data["inf"] is None and data["tags"] == ["a", "b"]
    assert data["n"] == 7 and data["t"] == [1, 2]
    assert out.read_text().endswith("\n")
    assert [p.name for p in out.parent.iterdir()] == ["r.json"]  # no temp files left behind


def test_write_json_records_the_machine(tmp_path):
    import os

    import torch

    data = json.loads(write_json(tmp_path / "r.json", {"ok": 1}).read_text())
    assert data["machine"]["torch_threads"] == torch.get_num_threads()
    assert data["machine"]["cpu_count"] == os.cpu_count()
    assert 1 <= data["machine"]["usable_cpus"] <= os.cpu_count()


def test_write_json_rejects_unknown_objects_and_keeps_old_file(tmp_path):
    target = write_json(tmp_path / "r.json", {"ok": 1})
    with pytest.raises(TypeError):
        write_json(target, {"bad": object()})
    data = json.loads(target.read_text())
    assert data["ok"] == 1 and "bad" not in data
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
