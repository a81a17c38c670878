"""`kvboost bench batch`: the same rows with shared-prefix attention on and off, identical outputs."""
from __future__ import annotations

from benchmarks.batch import _rows, _run
from kvboost import KVBoost

from ..tiny_models import make_tiny_model


def _engine(tokenizer) -> KVBoost:
    """An engine whose "on" runs share the prefix on every device: with a runner (CUDA graphs, fast_path "auto"
    on CUDA) a BatchRunner copies prefixes shorter than CASCADE_MIN_TOKENS per row: "on" would share nothing."""
    engine = KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16, fast_path="off")
    assert engine.runner is None
    return engine


def test_bench_runs_both_modes_on_a_tiny_model(tokenizer):
    engine = _engine(tokenizer)
    system_ids, rows = _rows(engine, n_rows=3, prefix=40)
    assert len(system_ids) == 40 and all(r[:40] == system_ids for r in rows)
    engine.warm_ids(system_ids, None)
    off = _run(engine, rows, 4, False, "off", 40)
    on = _run(engine, rows, 4, True, "on", 40)
    assert off.shared_prefix_tokens == 0 and on.shared_prefix_tokens == 32
    assert on.outputs == off.outputs
    assert on.kv_bytes_live < off.kv_bytes_live and on.decode_tokens == off.decode_tokens > 0


def test_rows_allocate_no_columns_for_the_shared_prefix(tokenizer):
    engine = _engine(tokenizer)
    system_ids, rows = _rows(engine, n_rows=3, prefix=300)  # longer than one 256-position growth step
    engine.warm_ids(system_ids, None)
    off = _run(engine, rows, 4, False, "off", 300)
    on = _run(engine, rows, 4, True, "on", 300)
    assert on.outputs == off.outputs and on.shared_prefix_tokens >= 256
    assert on.kv_bytes_allocated <= off.kv_bytes_allocated / 2


def test_bench_batch_is_registered():
    from typer.testing import CliRunner

    from kvboost.cli import app

    out = CliRunner().invoke(app, ["bench", "batch", "--help"])
    assert out.exit_code == 0 and "--rows" in out.output and "--prefix" in out.output and "--plot" in out.output


def test_bench_batch_plot_writes_a_png(tmp_path, tokenizer):
    from typer.testing import CliRunner

    from kvboost.cli import app

    model_dir = tmp_path / "model"
    make_tiny_model("llama", tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    png, js = tmp_path / "out" / "batch.png", tmp_path / "batch.json"
    out = CliRunner().invoke(app, ["bench", "batch", "--model", str(model_dir), "--rows", "2", "--prefix", "140",
                                   "--new-tokens", "3", "--json", str(js), "--plot", str(png)])
    assert out.exit_code == 0, out.output
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and png.stat().st_size > 2000
    assert js.is_file()
