"""Cost calculator: formulas against hand-computed values, validation, bench-JSON reading and the CLI."""
from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvboost.cost import (
    BenchSchemaError,
    CostInputError,
    cost_command,
    estimate_cost,
    read_bench_rates,
    render_cost_table,
)

SITE = dict(requests_per_day=100_000, prefix_tokens=4000, reuse_rate=0.86, prefill_tokens_per_s=10_000,
            usd_per_gpu_hour=0.75)


def test_product_site_example():
    est = estimate_cost(**SITE)
    assert est.tokens_saved_per_day == pytest.approx(344_000_000)
    assert est.gpu_seconds_per_day == pytest.approx(34_400)
    assert round(est.gpu_hours_per_day, 2) == 9.56  # the site rounds this to "about 9.6 GPU-hours/day"
    assert est.usd_per_day == pytest.approx(34_400 * 0.75 / 3600)  # $7.17
    assert est.usd_per_year == pytest.approx(7.1666667 * 365)  # a year is 365 days, not 12 x 30
    assert est.usd_per_month == pytest.approx(est.usd_per_year / 12)  # $217.99: an average month, 30.42 days
    assert round(est.usd_per_month, 2) == 217.99 and round(est.usd_per_year, 2) == 2615.83


def test_second_hand_computed_case():
    est = estimate_cost(1000, 2000, 0.5, 5000, 2.0)
    assert est.tokens_saved_per_day == pytest.approx(1_000_000)
    assert est.gpu_seconds_per_day == pytest.approx(200)
    assert est.gpu_hours_per_day == pytest.approx(200 / 3600)
    assert est.usd_per_day == pytest.approx(200 * 2.0 / 3600)
    assert est.usd_per_year == pytest.approx(365 * est.usd_per_day)
    assert est.usd_per_month == pytest.approx(365 / 12 * est.usd_per_day)
    assert asdict(est)["reuse_rate"] == 0.5


@pytest.mark.parametrize("field", ["requests_per_day", "prefix_tokens", "reuse_rate"])
def test_zero_volume_or_reuse_saves_nothing(field):
    est = estimate_cost(**{**SITE, field: 0})
    assert est.tokens_saved_per_day == 0 and est.usd_per_year == 0


@pytest.mark.parametrize("field,value", [
    ("requests_per_day", -1), ("prefix_tokens", -10), ("reuse_rate", -0.01), ("reuse_rate", 1.01),
    ("prefill_tokens_per_s", 0), ("prefill_tokens_per_s", -100), ("usd_per_gpu_hour", 0),
    ("usd_per_gpu_hour", -0.5), ("reuse_rate", math.nan), ("prefill_tokens_per_s", math.inf),
    ("requests_per_day", "100"), ("prefix_tokens", True),
])
def test_validation(field, value):
    with pytest.raises(ValueError, match=field) as info:  # the Python API names its parameters
        estimate_cost(**{**SITE, field: value})
    assert isinstance(info.value, CostInputError) and info.value.param == field


def test_reuse_bounds_are_inclusive():
    assert estimate_cost(**{**SITE, "reuse_rate": 1.0}).tokens_saved_per_day == pytest.approx(400_000_000)


# ------------------------------------------------------------------------------------------ bench JSON

def _bench(tmp_path, obj, name="bench.json") -> Path:
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return p


def test_read_bench_top_level_and_summary(tmp_path):
    top = read_bench_rates(_bench(tmp_path, {"reuse_rate": 0.9, "prefill_tokens_per_s": 12000, "x": 1}))
    assert (top.reuse_rate, top.prefill_tokens_per_s) == (0.9, 12000.0) and top.source.endswith("bench.json")
    nested = read_bench_rates(_bench(tmp_path, {"summary": {"reuse_rate": 0.7, "prefill_tokens_per_s": 800.5}}))
    assert (nested.reuse_rate, nested.prefill_tokens_per_s) == (0.7, 800.5)
    mixed = read_bench_rates(_bench(tmp_path, {"reuse_rate": 0.5, "summary": {"reuse_rate": 0.1,
                                                                              "prefill_tokens_per_s": 9}}))
    assert (mixed.reuse_rate, mixed.prefill_tokens_per_s) == (0.5, 9.0)  # top level wins


@pytest.mark.parametrize("content,message", [
    ({"prefill_tokens_per_s": 100}, "reuse_rate"),
    ({"summary": {"reuse_rate": 0.5}}, "prefill_tokens_per_s"),
    ({"summary": [1, 2]}, "reuse_rate"),
    ([1, 2], "JSON object"),
    ("{not json", "not valid JSON"),
    ({"reuse_rate": 1.5, "prefill_tokens_per_s": 100}, r"\[0, 1\]"),
    ({"reuse_rate": 0.5, "prefill_tokens_per_s": 0}, "> 0"),
    ({"reuse_rate": "high", "prefill_tokens_per_s": 100}, "must be a number"),
])
def test_read_bench_errors(tmp_path, content, message):
    with pytest.raises(BenchSchemaError, match=message):
        read_bench_rates(_bench(tmp_path, content))


def test_read_bench_missing_file(tmp_path):
    with pytest.raises(BenchSchemaError, match="not found"):
        read_bench_rates(tmp_path / "nope.json")


# ---------------------------------------------------------------------------------------------- CLI

@pytest.fixture
def run_cli():
    app = typer.Typer()
    app.command("cost")(cost_command)
    app.command("noop")(lambda: None)  # a second command keeps "cost" a named subcommand, as in kvboost's CLI
    runner = CliRunner()
    return lambda *args: runner.invoke(app, ["cost", *args], env={"COLUMNS": "200"})


def test_cli_defaults_are_the_site_example(run_cli):
    res = run_cli()
    assert res.exit_code == 0, res.output
    assert "344,000,000" in res.output and "9.56" in res.output and "$217.99" in res.output
    assert "$2,615.83" in res.output
    assert "365 days" in res.output and "365/12" in res.output  # the calendar is stated, not implied


def test_cli_json_and_flags(run_cli, tmp_path):
    out = tmp_path / "sub" / "cost.json"
    res = run_cli("--requests-per-day", "1000", "--prefix-tokens", "2000", "--reuse-rate", "0.5",
                  "--prefill-rate", "5000", "--usd-per-gpu-hour", "2", "--json", str(out))
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["tokens_saved_per_day"] == 1_000_000 and data["gpu_seconds_per_day"] == 200
    assert data["reuse_rate_source"] is None


def test_cli_from_bench_with_override(run_cli, tmp_path):
    bench = _bench(tmp_path, {"summary": {"reuse_rate": 0.5, "prefill_tokens_per_s": 20000}})
    out = tmp_path / "cost.json"
    res = run_cli("--from-bench", str(bench), "--prefill-rate", "10000", "--json", str(out))
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["reuse_rate"] == 0.5 and data["prefill_tokens_per_s"] == 10000  # explicit flag wins
    assert data["reuse_rate_source"] == str(bench) and data["prefill_rate_source"] is None
    assert data["tokens_saved_per_day"] == 100_000 * 4000 * 0.5


@pytest.mark.parametrize("args,flag,message", [
    (["--reuse-rate", "1.5"], "--reuse-rate", "within [0, 1]"),
    (["--prefill-rate", "0"], "--prefill-rate", "> 0"),
    (["--requests-per-day", "-5"], "--requests-per-day", ">= 0"),
    (["--prefix-tokens", "-1"], "--prefix-tokens", ">= 0"),
    (["--usd-per-gpu-hour", "0"], "--usd-per-gpu-hour", "> 0"),
    (["--from-bench", "/nonexistent/bench.json"], "--from-bench", "not found"),
])
def test_cli_errors_are_usage_errors_naming_the_flag(run_cli, args, flag, message):
    res = run_cli(*args)
    assert res.exit_code == 2 and flag in res.output and message in res.output
    for python_name in ("reuse_rate", "prefill_tokens_per_s", "requests_per_day", "prefix_tokens",
                        "usd_per_gpu_hour"):
        assert python_name not in res.output  # the user typed flags, not Python variables


def test_cost_command_callable_from_python(tmp_path, capsys):
    # Unspecified parameters are typer OptionInfo objects when called directly; they must fall back to defaults.
    est = cost_command(json_path=tmp_path / "c.json")
    assert est.tokens_saved_per_day == pytest.approx(344_000_000)
    assert json.loads((tmp_path / "c.json").read_text())["usd_per_month"] == pytest.approx(217.99, abs=0.01)
    assert "GPU-hours" in capsys.readouterr().out


def test_render_cost_table_names_sources():
    table = render_cost_table(estimate_cost(**SITE), reuse_source="b.json")
    labels = list(table.columns[0].cells)
    assert "Prefix reuse rate (from b.json)" in labels and "Prefill throughput" in labels
