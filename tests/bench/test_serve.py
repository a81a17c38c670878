"""`kvboost bench serve`: end to end on the tiny model (a short shared system prompt so it fits its context), with
its JSON and, with --plot, its PNG (matplotlib only when asked)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import serve as bench

from ..prompts import words
from ..tiny_models import make_tiny_model

pytest.importorskip("fastapi")
pytest.importorskip("openai")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A random 3-layer llama with SmolLM2's tokenizer (and chat template), saved like any --model folder."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_bench_serve_plot_writes_a_png(tmp_path, tokenizer, monkeypatch):
    from typer.testing import CliRunner

    from benchmarks import workloads
    from kvboost.cli import app

    model_dir = tmp_path / "model"
    make_tiny_model("llama", tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    # The shipped ~1,000-token prompt plus a question is longer than the tiny model's context.
    system = "You are a support bot. " + words(150, seed=11)
    questions = [{"question": f"question number {i}?", "answer": ""} for i in range(4)]
    monkeypatch.setattr(workloads, "load_system_prompt", lambda path=None: (system, questions))
    png, js = tmp_path / "out" / "serve.png", tmp_path / "serve.json"
    out = CliRunner().invoke(app, ["bench", "serve", "--model", str(model_dir), "--clients", "2", "--requests", "1",
                                   "--max-tokens", "2", "--max-batch-size", "2", "--batch-window-ms", "1",
                                   "--json", str(js), "--plot", str(png)])
    assert out.exit_code == 0, out.output
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and png.stat().st_size > 2000
    assert json.loads(js.read_text())["runs"]["chunk_kv_reuse"]["errors"] == 0


def test_bench_serve_lists_plot_and_imports_no_matplotlib():
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom kvboost.cli import app\n"
            "out = CliRunner().invoke(app, ['bench', 'serve', '--help'])\n"
            "assert out.exit_code == 0 and '--plot' in out.output, out.output\n"
            "import benchmarks.serve, benchmarks.batch\n"
            "assert 'matplotlib' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_percentile_interpolates():
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert bench.percentile([5.0], 90) == 5.0
    assert bench.percentile([10.0, 0.0], 90) == pytest.approx(9.0)


def test_bench_serve_runs_reuse_off_and_on_and_writes_json(tiny_model_dir, tmp_path, monkeypatch):
    from benchmarks import workloads

    system = "You are a support bot. " + words(150, seed=11)
    questions = [{"question": f"question number {i}?", "answer": ""} for i in range(8)]
    monkeypatch.setattr(workloads, "load_system_prompt", lambda path=None: (system, questions))
    out = tmp_path / "serve.json"
    bench.bench_serve_command(model=str(tiny_model_dir), clients=3, requests=2, max_tokens=3, max_batch_size=4,
                              batch_window_ms=5.0, json_path=str(out))
    report = json.loads(out.read_text())
    off, on = report["runs"]["baseline"], report["runs"]["chunk_kv_reuse"]
    assert off["requests"] == on["requests"] == 6 and off["errors"] == on["errors"] == 0
    assert off["mean_cached_tokens"] == 0 and on["mean_cached_tokens"] > 100
    assert report["requests_per_s_gain"] > 0 and report["ttft_p50_gain"] > 0
    assert set(report["targets"]) == {"requests_per_s_gain", "ttft_p50_gain"}
