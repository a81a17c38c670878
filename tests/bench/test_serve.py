"""`kvboost bench serve --plot`: end to end on a tiny model, the PNG is written (matplotlib only when asked)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ..prompts import words
from ..tiny_models import make_tiny_model

pytest.importorskip("fastapi")
pytest.importorskip("openai")


def test_bench_serve_plot_writes_a_png(tmp_path, tokenizer, monkeypatch):
    from typer.testing import CliRunner

    from kvboost.bench import workloads
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
            "import kvboost.bench.serve, kvboost.bench.batch\n"
            "assert 'matplotlib' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
