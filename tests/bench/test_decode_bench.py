"""`kvboost bench decode` end to end on the tiny shape, on the suite's device: every system measured, tokens
compared with HF."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kvboost.cli import app


def _run_options(device: torch.device) -> list[str]:
    """The bench's options on `device`. On CUDA its runner modes are eager and graphs (torch.compile is the CPU's
    mode): fp32 so that the tokens equal HF's, and more tokens, since a replayed step takes a fraction of a
    millisecond and 1 and N steps must time apart."""
    if device.type == "cpu":  # enough steps that n and 1 time apart on a busy machine (the rate is their difference)
        return ["--device", "cpu", "--new-tokens", "12"]
    return ["--device", str(device), "--dtype", "float32", "--new-tokens", "16"]


def _systems(device: torch.device) -> list[str]:
    if device.type != "cpu":  # no CPU Linear products to compare (cpu_linear is off there)
        return ["hf generate", "hf static", "kvboost off", "kvboost eager", "kvboost graphs"]
    ab = ["kvboost off, cpu_linear off"] if torch.backends.mkl.is_available() else []  # the same engine, own products
    # auto: off in the suite (KVBOOST_AOT=0, tests/conftest.py), the package elsewhere
    return ["hf generate", "hf static", "kvboost off", *ab, "kvboost eager", "kvboost compiled", "kvboost auto"]


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_bench_measures_every_mode_beside_hf(tmp_path, device, batch):
    """Batch 1, and 3 prompts decoded together (KVBoost's generate_batch: on CPU the compiled mode's rows step)."""
    threads = torch.get_num_threads()
    js = tmp_path / "decode.json"
    options = _run_options(device)
    try:
        out = CliRunner().invoke(app, ["bench", "decode", "--shape", "tiny", *options, "--prompt", "32",
                                       "--repeats", "3", "--threads", "1", "--batch", str(batch), "--json", str(js)])
    finally:
        torch.set_num_threads(threads)
    assert out.exit_code == 0, out.output
    data = json.loads(js.read_text())
    assert data["benchmark"] == "decode" and data["threads"] == 1 and data["shape"] == "tiny"
    assert data["batch"] == batch
    assert [r["system"] for r in data["rows"]] == _systems(device)
    new_tokens = int(options[options.index("--new-tokens") + 1])
    for row in data["rows"]:
        assert row["identical_to_hf_generate"], row
        assert row["decode_tokens"] == (new_tokens - 1) * batch and row["decode_tok_s"] > 0
    assert next(r for r in data["rows"] if r["system"] == "kvboost off")["over_kvboost_off"] == 1.0
    kernels = {r["system"]: r.get("decode_kernels") for r in data["rows"]}
    assert kernels["kvboost eager"] is None
    if device.type == "cpu":
        assert kernels["kvboost compiled"]  # which GEMV kernels decoded
    else:
        assert kernels["kvboost graphs"] is None  # GEMV kernels are the compiled (CPU) mode's
