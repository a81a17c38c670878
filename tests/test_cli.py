"""The command line as a user runs it (in a subprocess, so entry points and imports are real)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvboost
from kvboost.benchmarks_finder import NEEDS_A_CHECKOUT
from kvboost.install_source import UNKNOWN_SOURCE

from .tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
# The clone the running kvboost comes from (tests run from a checkout): install hints name it, editable.
CLONE = Path(kvboost.__file__).resolve().parents[2]
# Everything the optional extras (and the test extra's openai) bring; a plain `pip install kvboost` has none.
EXTRA_MODULES = ("fastapi", "uvicorn", "sse_starlette", "prometheus_client", "redis", "matplotlib", "openai")


def kvboost_cli(*args: str, timeout: int = 600, columns: int = 200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvboost.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": str(columns)})


def kvboost_without(blocked: tuple[str, ...], *args: str, cwd: Path | None = None,
                    pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    """The CLI in a process where `blocked` cannot be imported (None in sys.modules), as on a bare install.
    cwd / pythonpath: run it elsewhere, with only that folder on PYTHONPATH."""
    prelude = (f"import sys\nfor m in {list(blocked)!r}: sys.modules[m] = None\n"
               f"sys.argv = ['kvboost', *{list(args)!r}]\nfrom kvboost.cli import main\nmain()\n")
    env = {**os.environ, "COLUMNS": "200"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-c", prelude], capture_output=True, text=True, timeout=300, env=env,
                          cwd=cwd)


def hint(extras: str) -> str:
    """The install hint's pip command for `extras`: from this clone, editable."""
    return f"pip install -e '{CLONE}[{extras}]'"


def test_help_lists_commands_and_benchmarks():
    out = kvboost_cli("--help")
    assert out.returncode == 0
    for name in ("demo", "verify", "bench", "cost"):
        assert name in out.stdout
    bench = kvboost_cli("bench", "--help").stdout
    for name in ("prefix", "multiturn", "quant", "serve", "rag", "structured", "longctx"):
        assert name in bench


def test_cost_prints_and_writes_json(tmp_path):
    path = tmp_path / "cost.json"
    out = kvboost_cli("cost", "--requests-per-day", "100000", "--prefix-tokens", "4000", "--reuse-rate", "0.86",
                  "--prefill-rate", "10000", "--json", str(path))
    assert out.returncode == 0, out.stderr
    data = json.loads(path.read_text())
    assert round(data["gpu_hours_per_day"], 2) == 9.56


def test_verify_on_a_local_model(tmp_path, tokenizer):
    make_tiny_model("qwen2", tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    out = kvboost_cli("verify", "--model", str(tmp_path), "--max-new-tokens", "6", columns=80)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3/3 prompts identical" in out.stdout
    # One table row and one line per prompt at 80 columns, never wrapped over several lines.
    lines = out.stdout.splitlines()
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == 3 and all("yes" in row for row in rows), out.stdout
    prompts = [line for line in lines if re.match(r" +[1-3]  \S", line)]
    assert len(prompts) == 3 and all(len(line) <= 80 for line in prompts), out.stdout
    assert "delivery address? Answer:" in prompts[0] and "one sentence:" in prompts[2]


def test_unknown_model_path_fails_cleanly(tmp_path):
    out = kvboost_cli("verify", "--model", str(tmp_path / "missing"))
    assert out.returncode != 0
    assert "Traceback" not in out.stdout + out.stderr and "cannot load model" in out.stderr


@pytest.mark.slow
def test_demo_runs_on_the_embedded_model():
    out = kvboost_cli("demo", "--questions", "1", "--max-new-tokens", "4")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "TTFT: baseline" in out.stdout and "KVBoost" in out.stdout and "yes" in out.stdout
    # The question reused the system prompt's stored tokens, no more: "warmed N ... tokens", then "N/<prompt>".
    warmed = int(re.search(r"warmed (\d+) system-prompt tokens", out.stdout).group(1))
    assert re.search(rf"\b{warmed}/\d+\b", out.stdout), out.stdout
    assert "135M parameters" in out.stdout  # the answers are a small model's, and the demo says so


def test_version_is_the_package_version_and_pyproject_agrees():
    out = kvboost_cli("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"kvboost {kvboost.__version__}"
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")  # tomllib is 3.11+; we support 3.10
    assert re.search(r'^version = "([^"]+)"$', pyproject, re.M).group(1) == kvboost.__version__


def test_core_commands_run_without_any_extra(tmp_path):
    assert kvboost_without(EXTRA_MODULES, "--help").returncode == 0
    assert kvboost_without(EXTRA_MODULES, "bench", "--help").returncode == 0
    assert kvboost_without(EXTRA_MODULES, "--version").stdout.strip() == f"kvboost {kvboost.__version__}"
    out = kvboost_without(EXTRA_MODULES, "cost", "--json", str(tmp_path / "c.json"))
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "c.json").read_text())["usd_per_day"] > 0


def _one_line_hint(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.mark.parametrize("args", [("serve",), ("serve", "--port", "0", "--model", "x")])
def test_serve_without_the_server_extra_prints_the_install_hint(args):
    line = _one_line_hint(kvboost_without(("fastapi",), *args))
    # Installed from this clone: the extra from this clone, never PyPI's `kvboost` (another project).
    assert line == f"kvboost serve needs the server extra: {hint('server')}"


def test_bench_structured_names_the_missing_extra():
    line = _one_line_hint(kvboost_without(("xgrammar",), "bench", "structured", "--schemas", "1"))
    assert line == f"kvboost bench structured needs the structured extra: {hint('structured')}"


def test_bench_serve_names_what_is_missing():
    line = _one_line_hint(kvboost_without(("fastapi", "openai"), "bench", "serve", "--requests", "1"))
    assert line.startswith("kvboost bench serve needs the server extra and the openai package")
    assert line.endswith(f"{hint('server')} openai")


@pytest.mark.parametrize("command", ["prefix", "quant", "multiturn", "batch", "rag"])
def test_plot_without_matplotlib_fails_before_the_benchmark_runs(command, tmp_path):
    # The check comes first: no model is loaded (that would take far longer than this test allows).
    out = kvboost_without(("matplotlib",), "bench", command, "--model", str(tmp_path / "missing"),
                          "--plot", str(tmp_path / "p.png"))
    assert _one_line_hint(out) == f"kvboost bench {command} --plot needs the bench extra: {hint('bench')}"


def test_help_shows_flags_as_flags_and_named_values():
    top = kvboost_cli("--help").stdout
    assert "<" not in top and re.search(r"--version +Print the version", top), top
    prefix = kvboost_cli("bench", "prefix", "--help").stdout
    assert "<" not in prefix, prefix  # no <bool>, <str>, <int range> placeholders
    assert re.search(r"--host-tier +Also the host tier", prefix), prefix
    assert re.search(r"--help +Show this message", prefix), prefix
    assert re.search(r"--json +JSON_PATH +Write", prefix) and re.search(r"--repeats +REPEATS \[x>=1\]", prefix)


def test_benchmarks_found_beside_an_editable_install(tmp_path):
    # Run from elsewhere (the clone is not the current directory): kvboost's source sits in <clone>/src.
    out = kvboost_without((), "bench", "--help", cwd=tmp_path, pythonpath=ROOT / "src")
    assert out.returncode == 0, out.stderr
    assert all(name in out.stdout for name in ("prefix", "spec", "gpu", "longctx"))


@pytest.fixture(scope="module")
def installed_copy(tmp_path_factory) -> Path:
    """The package alone, as a non-editable install leaves it: no clone around it, no benchmarks beside it."""
    site = tmp_path_factory.mktemp("site-packages")
    shutil.copytree(ROOT / "src" / "kvboost", site / "kvboost", ignore=shutil.ignore_patterns("__pycache__"))
    return site


@pytest.mark.parametrize("args", [("bench", "prefix", "--repeats", "1"), ("bench", "--help"), ("eval", "rag")])
def test_benchmarks_outside_a_checkout_exit_2_with_one_line(installed_copy, args):
    out = kvboost_without((), *args, cwd=installed_copy, pythonpath=installed_copy)
    assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == [NEEDS_A_CHECKOUT]


def test_outside_a_checkout_the_core_runs_and_hints_name_no_pypi_package(installed_copy, tmp_path):
    assert "bench" in kvboost_without((), "--help", cwd=installed_copy, pythonpath=installed_copy).stdout
    cost = kvboost_without((), "cost", "--json", str(tmp_path / "c.json"), cwd=installed_copy,
                           pythonpath=installed_copy)
    assert cost.returncode == 0, cost.stderr
    line = _one_line_hint(kvboost_without(("fastapi",), "serve", cwd=installed_copy, pythonpath=installed_copy))
    assert line == f"kvboost serve needs the server extra: pip install '{UNKNOWN_SOURCE}[server]'"
