"""The product site's GPU-cost calculator, as a pure function plus the ``kvboost cost`` CLI command:

    tokens_saved_per_day = requests_per_day * prefix_tokens * reuse_rate
    gpu_seconds_per_day  = tokens_saved_per_day / prefill_tokens_per_s
    usd_per_day          = gpu_seconds_per_day * usd_per_gpu_hour / 3600; usd_per_month = 365 * usd_per_day / 12

``--from-bench`` reads ``reuse_rate`` and ``prefill_tokens_per_s`` from a bench JSON, top level or under ``summary``."""
from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

# The product site's example; the CLI uses these when neither a flag nor a bench file gives a value.
DEFAULT_REQUESTS_PER_DAY = 100_000
DEFAULT_PREFIX_TOKENS = 4_000
DEFAULT_REUSE_RATE = 0.86
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
DEFAULT_USD_PER_GPU_HOUR = 0.75
DAYS_PER_YEAR = 365
DAYS_PER_MONTH = DAYS_PER_YEAR / 12  # an average month, so that 12 months make the year

# The flag each estimate_cost parameter comes from, so CLI errors name what the user typed.
FLAGS = {"requests_per_day": "--requests-per-day", "prefix_tokens": "--prefix-tokens", "reuse_rate": "--reuse-rate",
         "prefill_tokens_per_s": "--prefill-rate", "usd_per_gpu_hour": "--usd-per-gpu-hour"}


@dataclass(frozen=True)
class CostEstimate:
    requests_per_day: float
    prefix_tokens: float
    reuse_rate: float
    prefill_tokens_per_s: float
    usd_per_gpu_hour: float
    tokens_saved_per_day: float
    gpu_seconds_per_day: float
    gpu_hours_per_day: float
    usd_per_day: float
    usd_per_month: float
    usd_per_year: float


@dataclass(frozen=True)
class BenchRates:
    reuse_rate: float
    prefill_tokens_per_s: float
    source: str  # path of the bench JSON the rates came from


class BenchSchemaError(ValueError):
    """The bench JSON lacks ``reuse_rate`` / ``prefill_tokens_per_s`` or holds invalid values."""


class CostInputError(ValueError):
    """An estimate_cost argument is invalid; ``param`` names it, ``problem`` says what is wrong with it."""

    def __init__(self, param: str, problem: str):
        super().__init__(f"{param} {problem}")
        self.param, self.problem = param, problem


def _number(name: str, value: Any) -> float:
    # bool is an int subclass; True as "1 request/day" is always a bug upstream.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CostInputError(name, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise CostInputError(name, f"must be finite, got {value!r}")
    return float(value)


_RANGES = {"requests_per_day": (lambda v: v >= 0, "must be >= 0"), "prefix_tokens": (lambda v: v >= 0, "must be >= 0"),
           "reuse_rate": (lambda v: 0.0 <= v <= 1.0, "must be within [0, 1]"),
           "prefill_tokens_per_s": (lambda v: v > 0, "must be > 0"),
           "usd_per_gpu_hour": (lambda v: v > 0, "must be > 0")}


def _checked(raw: dict[str, Any]) -> dict[str, float]:
    """Every value as a float (all checked as numbers first), then each within its range (_RANGES)."""
    values = {name: _number(name, value) for name, value in raw.items()}
    for name, value in values.items():
        ok, rule = _RANGES[name]
        if not ok(value):
            raise CostInputError(name, f"{rule}, got {value:g}")
    return values


def estimate_cost(requests_per_day: float, prefix_tokens: float, reuse_rate: float, prefill_tokens_per_s: float,
                  usd_per_gpu_hour: float) -> CostEstimate:
    """GPU time and money saved by reusing cached prefixes (module doc formulas); CostInputError for bad inputs."""
    req, pre, reuse, rate, usd = _checked(dict(zip(_RANGES, (requests_per_day, prefix_tokens, reuse_rate,
                                                             prefill_tokens_per_s, usd_per_gpu_hour)))).values()
    tokens = req * pre * reuse
    gpu_s = tokens / rate
    usd_day = gpu_s * usd / 3600
    return CostEstimate(requests_per_day=req, prefix_tokens=pre, reuse_rate=reuse, prefill_tokens_per_s=rate,
                        usd_per_gpu_hour=usd, tokens_saved_per_day=tokens, gpu_seconds_per_day=gpu_s,
                        gpu_hours_per_day=gpu_s / 3600, usd_per_day=usd_day, usd_per_month=usd_day * DAYS_PER_MONTH,
                        usd_per_year=usd_day * DAYS_PER_YEAR)


def _lookup(data: dict[str, Any], key: str, path: Path) -> Any:
    for scope in (data, data.get("summary")):  # the top level wins
        if isinstance(scope, dict) and key in scope:
            return scope[key]
    raise BenchSchemaError(
        f"{path}: no {key!r} found; expected a top-level key or one inside a 'summary' object, e.g. "
        '{"reuse_rate": 0.86, "prefill_tokens_per_s": 10000} or {"summary": {...}}')


def read_bench_rates(path: str | Path) -> BenchRates:
    """Read ``reuse_rate`` and ``prefill_tokens_per_s`` from a benchmark JSON (schema in the module doc)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BenchSchemaError(f"{p}: bench file not found") from None
    except json.JSONDecodeError as e:
        raise BenchSchemaError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise BenchSchemaError(f"{p}: expected a JSON object at the top level, got {type(data).__name__}")
    try:
        rates = _checked({key: _lookup(data, key, p) for key in ("reuse_rate", "prefill_tokens_per_s")})
    except CostInputError as e:  # "<key> must be ..."
        raise BenchSchemaError(f"{p}: {e}") from None
    return BenchRates(**rates, source=str(p))


def render_cost_table(est: CostEstimate, reuse_source: str | None = None, prefill_source: str | None = None) -> Table:
    """Inputs then savings, formatted the way the product site shows them; sources name bench files."""
    table = Table(title="KVBoost prefill savings estimate", show_header=True)
    table.add_column("Quantity")
    table.add_column("Value", justify="right")
    rows = [
        ("Requests per day", f"{est.requests_per_day:,.0f}"),
        ("Shared prefix tokens per request", f"{est.prefix_tokens:,.0f}"),
        ("Prefix reuse rate" + (f" (from {reuse_source})" if reuse_source else ""), f"{est.reuse_rate:.1%}"),
        ("Prefill throughput" + (f" (from {prefill_source})" if prefill_source else ""),
         f"{est.prefill_tokens_per_s:,.0f} tok/s"),
        ("GPU price", f"${est.usd_per_gpu_hour:,.2f}/h"),
        ("Prefill tokens saved per day", f"{est.tokens_saved_per_day:,.0f}"),
        ("GPU-hours saved per day", f"{est.gpu_hours_per_day:,.2f}"),
        ("Saved per day", f"${est.usd_per_day:,.2f}"),
        (f"Saved per month ({DAYS_PER_YEAR}/12 = {DAYS_PER_MONTH:.2f} days)", f"${est.usd_per_month:,.2f}"),
        (f"Saved per year ({DAYS_PER_YEAR} days)", f"${est.usd_per_year:,.2f}"),
    ]
    for i, (k, v) in enumerate(rows):
        table.add_row(k, v, end_section=(i == 4))  # rule between inputs and results
    return table


def _plain(value: Any) -> Any:
    # Calling cost_command() from Python leaves unspecified parameters as typer OptionInfo objects.
    return value.default if isinstance(value, typer.models.OptionInfo) else value


def cost_command(
    requests_per_day: float = typer.Option(DEFAULT_REQUESTS_PER_DAY, "--requests-per-day",
                                           help="Requests served per day."),
    prefix_tokens: float = typer.Option(DEFAULT_PREFIX_TOKENS, "--prefix-tokens",
                                        help="Shared prefix length per request, in tokens."),
    reuse_rate: float | None = typer.Option(
        None, "--reuse-rate", show_default=False,
        help="Fraction of prefix tokens served from cache, 0..1. "
             f"Default: the --from-bench value, else {DEFAULT_REUSE_RATE}."),
    prefill_rate: float | None = typer.Option(
        None, "--prefill-rate", show_default=False,
        help="Baseline prefill throughput in tokens/s. "
             f"Default: the --from-bench value, else {DEFAULT_PREFILL_TOKENS_PER_S:g}."),
    usd_per_gpu_hour: float = typer.Option(DEFAULT_USD_PER_GPU_HOUR, "--usd-per-gpu-hour",
                                           help="GPU price in USD per hour."),
    from_bench: Path | None = typer.Option(
        None, "--from-bench", help="Bench JSON providing reuse_rate and prefill_tokens_per_s (explicit flags win)."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the estimate to this JSON file."),
) -> CostEstimate:
    """Estimate GPU time and money saved by KV-cache prefix reuse."""
    requests_per_day, prefix_tokens, reuse_rate, prefill_rate, usd_per_gpu_hour, from_bench, json_path = map(
        _plain, (requests_per_day, prefix_tokens, reuse_rate, prefill_rate, usd_per_gpu_hour, from_bench, json_path))
    reuse_src = prefill_src = None  # which bench file each rate came from, for the table and the JSON
    try:
        if from_bench is not None:
            rates = read_bench_rates(from_bench)
            if reuse_rate is None:
                reuse_rate, reuse_src = rates.reuse_rate, rates.source
            if prefill_rate is None:
                prefill_rate, prefill_src = rates.prefill_tokens_per_s, rates.source
        est = estimate_cost(requests_per_day, prefix_tokens,
                            DEFAULT_REUSE_RATE if reuse_rate is None else reuse_rate,
                            DEFAULT_PREFILL_TOKENS_PER_S if prefill_rate is None else prefill_rate, usd_per_gpu_hour)
    except CostInputError as e:  # named by the flag the user typed, not the Python parameter
        raise typer.BadParameter(e.problem, param_hint=FLAGS[e.param]) from None
    except BenchSchemaError as e:  # typer renders both as a usage error (exit code 2)
        raise typer.BadParameter(str(e), param_hint="--from-bench") from None
    Console().print(render_cost_table(est, reuse_source=reuse_src, prefill_source=prefill_src))
    if json_path is not None:  # indented JSON, written atomically (temp file + rename)
        record = {**asdict(est), "reuse_rate_source": reuse_src, "prefill_rate_source": prefill_src}
        out = Path(json_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
                fh.write(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
            os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; an estimate is meant to be shared
            os.replace(tmp, out)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return est
