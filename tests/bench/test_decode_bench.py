"""`kvboost bench decode` end to end on the tiny shape (CPU): every system measured, tokens compared with HF."""
from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from kvboost.cli import app


def test_decode_bench_measures_every_mode_beside_hf(tmp_path):
    threads = torch.get_num_threads()
    js = tmp_path / "decode.json"
    try:
        out = CliRunner().invoke(app, ["bench", "decode", "--shape", "tiny", "--device", "cpu", "--prompt", "32",
                                       "--new-tokens", "4", "--repeats", "1", "--threads", "1", "--json", str(js)])
    finally:
        torch.set_num_threads(threads)
    assert out.exit_code == 0, out.output
    data = json.loads(js.read_text())
    assert data["benchmark"] == "decode" and data["threads"] == 1 and data["shape"] == "tiny"
    systems = [r["system"] for r in data["rows"]]
    ab = ["kvboost off, cpu_linear off"] if torch.backends.mkl.is_available() else []  # the same engine, own products
    assert systems == ["hf generate", "hf static", "kvboost off", *ab, "kvboost eager", "kvboost compiled"]
    for row in data["rows"]:
        assert row["identical_to_hf_generate"], row
        assert row["decode_tokens"] == 3 and row["decode_tok_s"] > 0
    assert next(r for r in data["rows"] if r["system"] == "kvboost off")["over_kvboost_off"] == 1.0
    kernels = {r["system"]: r.get("decode_kernels") for r in data["rows"]}
    assert kernels["kvboost eager"] is None and kernels["kvboost compiled"]  # which GEMV kernels decoded
