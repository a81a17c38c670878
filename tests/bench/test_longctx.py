"""`kvboost bench longctx` end to end on the tiny shape (CPU): the resident and streamed rows decode the same
tokens, the streamed one over host blocks, and the bound is computed from what it moved."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from kvboost.cli import app


def test_longctx_bench_streams_and_reports_the_bound(tmp_path):
    js, prof = tmp_path / "longctx.json", tmp_path / "profile.txt"
    out = CliRunner().invoke(app, ["bench", "longctx", "--shape", "tiny", "--device", "cpu", "--context", "300",
                                   "--new-tokens", "4", "--repeats", "1", "--json", str(js), "--profile", str(prof)])
    assert out.exit_code == 0, out.output
    data = json.loads(js.read_text())
    assert data["benchmark"] == "longctx" and data["identical"] is True
    resident, streamed = data["rows"]
    assert (resident["system"], streamed["system"]) == ("resident", "streamed")
    assert streamed["streamed_requests"] == 1 + 2  # measure(): the warm-up, then time(1) and time(n)
    # Every decode step brings the context (all layers, K and V) to the device but for the positions it keeps.
    per_token = data["kv_bytes"] / (data["context_tokens"] + 4)
    crossing = data["context_tokens"] - data["device_kv_max_tokens"]
    assert crossing * per_token <= streamed["bytes_per_step"] <= (crossing + 4) * per_token
    assert data["device_kv_max_tokens"] < data["context_tokens"]
    assert data["bound_tok_s"] > 0 and data["copy_bandwidth_gb_s"] > 0
    assert streamed["host_pinned"] is False  # a CPU "device": host blocks are plain memory
    profile = prof.read_text()  # one streamed request under torch.profiler: its ops, heaviest first
    assert "sorted by self_cpu_time_total" in profile and "aten::" in profile
