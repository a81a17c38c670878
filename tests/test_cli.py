"""The command line as a user runs it (in a subprocess, so entry points and imports are real)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .tiny_models import make_tiny_model


def kvboost(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvboost.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**__import__("os").environ, "COLUMNS": "200"})


def test_help_lists_commands_and_benchmarks():
    out = kvboost("--help")
    assert out.returncode == 0
    for name in ("demo", "verify", "bench", "cost"):
        assert name in out.stdout
    bench = kvboost("bench", "--help").stdout
    for name in ("prefix", "multiturn", "quant", "serve", "rag"):
        assert name in bench


def test_cost_prints_and_writes_json(tmp_path):
    path = tmp_path / "cost.json"
    out = kvboost("cost", "--requests-per-day", "100000", "--prefix-tokens", "4000", "--reuse-rate", "0.86",
                  "--prefill-rate", "10000", "--json", str(path))
    assert out.returncode == 0, out.stderr
    data = json.loads(path.read_text())
    assert round(data["gpu_hours_per_day"], 2) == 9.56


def test_verify_on_a_local_model(tmp_path, tokenizer):
    make_tiny_model("qwen2", tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    out = kvboost("verify", "--model", str(tmp_path), "--max-new-tokens", "6")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3/3 prompts identical" in out.stdout


def test_unknown_model_path_fails_cleanly(tmp_path):
    out = kvboost("verify", "--model", str(tmp_path / "missing"))
    assert out.returncode != 0
    assert "Traceback" not in out.stdout + out.stderr and "cannot load model" in out.stderr


@pytest.mark.slow
def test_demo_runs_on_the_embedded_model():
    out = kvboost("demo", "--questions", "1", "--max-new-tokens", "4")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "KVBoost TTFT" in out.stdout and "yes" in out.stdout
