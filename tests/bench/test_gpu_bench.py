"""--shape/--device/--dtype on the bench commands and `kvboost bench gpu`, end to end on the tiny shape (CPU)."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kvboost.cli import app

BENCH_COMMANDS = ("prefix", "quant", "multiturn", "serve", "batch", "rag", "gpu", "decode")


def _invoke(args: list[str]):
    return CliRunner().invoke(app, args)


def _text(result) -> str:
    """The output with rich's error box and line wrapping taken out."""
    return " ".join(result.output.replace("│", " ").split())


@pytest.mark.parametrize("command", BENCH_COMMANDS)
def test_every_bench_command_takes_the_model_options(command):
    out = _invoke(["bench", command, "--help"])
    assert out.exit_code == 0, out.output
    for option in ("--model", "--shape", "--device", "--dtype"):
        assert option in out.output, (command, option)


def test_prefix_runs_on_a_shape_and_records_it(tmp_path, one_thread):
    js = tmp_path / "prefix.json"
    out = _invoke(["bench", "prefix", "--shape", "tiny", "--device", "cpu", "--lengths", "150,300",
                   "--repeats", "1", "--json", str(js)])
    assert out.exit_code == 0, out.output
    data = json.loads(js.read_text())
    assert (data["shape"], data["device"], data["dtype"]) == ("tiny", "cpu", "float32")
    assert data["model"] == "shape tiny (random weights)" and "machine" in data
    assert [r["prefix_tokens"] for r in data["rows"]] == [150, 300]
    assert all(r["cached_tokens"] >= 128 for r in data["rows"])


def test_prefix_host_tier_row(tmp_path, one_thread):
    js = tmp_path / "prefix.json"
    out = _invoke(["bench", "prefix", "--shape", "tiny", "--device", "cpu", "--lengths", "300", "--repeats", "1",
                   "--host-tier", "--json", str(js)])
    assert out.exit_code == 0, out.output
    assert "host/kvb" in out.output
    (row,) = json.loads(js.read_text())["rows"]
    tier = row["tiers"]
    assert tier["host_over_floor"] > 0 and tier["host_over_resident"] > 0, tier
    assert row["store_over_resident"] > 0
    assert tier["host_cached_tokens"] > 0
    assert tier["host_restored_from_host"] >= 2  # the timed requests read their chunks from the host tier


@pytest.mark.parametrize("command", ["prefix", "gpu", "batch"])
def test_unknown_shape_is_a_usage_error_listing_the_known_ones(command):
    out = _invoke(["bench", command, "--shape", "qwen9"])
    assert out.exit_code == 2
    text = _text(out)
    assert "unknown shape 'qwen9'" in text and "qwen2.5-3b" in text and "llama-3.1-8b" in text


def test_model_and_shape_are_mutually_exclusive():
    out = _invoke(["bench", "prefix", "--shape", "tiny", "--model", "some/model"])
    assert out.exit_code == 2 and "mutually exclusive" in _text(out)


@pytest.mark.parametrize("args", [["bench", "quant"], ["bench", "rag"], ["eval", "rag"]])
def test_quality_benchmarks_refuse_random_weights(args):
    out = _invoke([*args, "--shape", "tiny"])
    assert out.exit_code == 2 and "random weights make meaningless" in _text(out)


def test_bad_dtype_and_missing_cuda_are_usage_errors():
    out = _invoke(["bench", "batch", "--shape", "tiny", "--dtype", "int3"])
    assert out.exit_code == 2 and "unknown dtype 'int3'" in _text(out)
    if not torch.cuda.is_available():
        out = _invoke(["bench", "gpu", "--device", "cuda"])
        assert out.exit_code == 2 and "no CUDA device" in _text(out)


def test_bench_gpu_quick_writes_every_section(tmp_path, one_thread, device):
    """`kvboost bench gpu --shape tiny --quick` on the suite's device (cpu here; cuda under --device cuda)."""
    js, png = tmp_path / "gpu.json", tmp_path / "out" / "gpu.png"
    # Each section gets a share of --time-limit (fidelity 6%: ~30 s of the default 510) and stops between
    # measurements once it is spent. On a GPU every fidelity case builds an engine (Triton compiles, graph
    # captures): ~5 s in all alone, but past 30 s while the suite's other workers share the GPU and cores, which
    # cut the mistral rows. The shares are caps, not waits: a generous limit costs nothing on a free machine.
    limit = [] if device.type == "cpu" else ["--time-limit", "3000"]
    out = _invoke(["bench", "gpu", "--shape", "tiny", "--device", str(device), "--quick", "--max-prefix", "1000",
                   *limit, "--json", str(js), "--plot", str(png)])
    assert out.exit_code == 0, out.output
    data = json.loads(js.read_text())
    assert data["complete"] and (data["shape"], data["dtype"]) == ("tiny", "float32" if device.type == "cpu"
                                                                   else "bfloat16")
    assert data["device"].startswith(device.type) and "machine" in data
    sections = data["sections"]
    assert set(sections) == {"fidelity", "chat", "prefix", "decode", "kernels"}
    assert all(s["status"] in ("ok", "truncated") for s in sections.values()), {
        k: (s["status"], s.get("reason")) for k, s in sections.items()}
    chat = sections["chat"]
    assert [r["turn"] for r in chat["per_turn"]] == [1, 2, 3, 4, 5, 6]
    assert all(r["kvboost_cached"] > 800 for r in chat["per_turn"][1:])  # the ~900-token system prompt and more
    assert set(chat["spike"]) == {"plain", "manual", "kvboost"}
    assert [r["prefix_tokens"] for r in sections["prefix"]["rows"]] == [1000]  # --max-prefix caps the sweep
    row = sections["prefix"]["rows"][0]
    assert sections["prefix"]["tier_errors"] == {} and not any(k.endswith("_error") for k in row), row
    assert row["store_over_floor"] > 0 and row["host_over_floor"] > 0
    assert row["host_restored_from_host"] >= 7  # the host row's chunks came from the host tier
    decode = {(r["system"], r["batch"]): r for r in sections["decode"]["rows"]}
    for batch in data["settings"]["batch_sizes"]:
        assert decode[("kvboost", batch)]["status"] == decode[("hf eager", batch)]["status"] == "ok"
        compiled = decode[("hf static+compile", batch)]
        assert compiled["status"] == "skipped" and compiled["reason"]  # CPU / --quick: said why
    fidelity = sections["fidelity"]
    assert [(r["model"], r["dtype"]) for r in fidelity["rows"]] == [  # the bench's own model first
        ("tiny", "bfloat16"), ("tiny", "float32"),
        ("llama", "bfloat16"), ("llama", "float32"), ("mistral", "bfloat16"), ("mistral", "float32")]
    assert (fidelity["prefix_tokens"], fidelity["questions"]) == (160, 2)  # --quick sizes
    for r in fidelity["rows"]:
        assert r["questions"] == 2 and 0 <= r["kvboost_identical"] <= 2 and 0 <= r["recipe_identical"] <= 2
        assert r["kvboost_cached_mean"] >= 128  # the stored prefix was reused: at least its full chunk
        for system, steps in r["fp32_steps"].items():  # every continuation scored step by step against fp32
            assert 0 < steps["steps"] <= 2 * 8 and steps["off_argmax"] == len(steps["deficits"]), (r["model"], system)
            assert steps["fp32_argmax"] + steps["off_argmax"] == steps["steps"]
            if r["dtype"] == "float32" and device.type == "cpu":  # its own teacher, the same CPU kernels
                assert steps["fp32_argmax"] == steps["steps"], (r["model"], system, steps)
    fp32 = fidelity["totals"]["float32"]
    if device.type == "cpu":  # fp32 on CPU: the same kernels as HF generate, so every token is identical
        assert fp32["kvboost_identical"] == fp32["recipe_identical"] == fp32["questions"] == 6
    assert data["measured"]["fidelity_fp32_kvboost"] == f"{fp32['kvboost_identical']}/6"
    assert data["measured"]["fidelity_bf16_recipe"].endswith("/6")
    assert data["measured"]["fidelity_bf16_kvboost_fp32_argmax"].endswith(
        f"/{fidelity['totals']['bfloat16']['fp32_steps']['kvboost']['steps']}")
    kernels = sections["kernels"]
    assert kernels["sdpa"] and kernels["kernel"]["status"] in ("ok", "unavailable")
    assert kernels["kernel"]["status"] == "ok" or kernels["kernel"]["reason"]
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and png.stat().st_size > 5000


def test_kernel_rows_are_normalized_and_compared_with_flash_lower_right():
    from dataclasses import dataclass

    from benchmarks.gpu.kernels import _as_rows, _call, with_speedups

    @dataclass
    class Row:
        shape: str
        impl: str
        median_ms: float

    rows = with_speedups(_as_rows([Row("s", "triton", 0.5), Row("s", "sdpa_lower_right", 1.0)]))
    assert rows[0]["speedup_vs_sdpa_lower_right"] == 2.0
    assert _as_rows({"a": {"median_ms": 1.0}}) == [{"case": "a", "median_ms": 1.0}]

    def timings(device, dtype, *, repeats=20):
        return {"device": device, "dtype": dtype, "repeats": repeats}

    assert _call(timings, {"device": "cpu", "dtype": torch.float32, "repeats": 3, "quick": True}) == {
        "device": "cpu", "dtype": torch.float32, "repeats": 3}


def test_section_budgets_are_explicit_seconds_or_shares_of_what_the_explicit_ones_leave():
    from benchmarks.gpu.command import section_seconds
    from benchmarks.gpu.settings import SHARES, GpuBenchSettings

    s = GpuBenchSettings(budgets={"fidelity": 130, "decode": 120})
    assert section_seconds(s, ["fidelity", "chat", "prefix", "decode"], 330) == 130
    assert section_seconds(s, ["fidelity"], 50) == 50  # capped by what is left of the run
    # chat and prefix share what decode's 120 s leave of 200 s, by their shares
    assert section_seconds(s, ["chat", "prefix", "decode"], 200) == pytest.approx(
        80 * SHARES["chat"] / (SHARES["chat"] + SHARES["prefix"]))
    assert section_seconds(s, ["decode"], 100) == 100 and section_seconds(s, ["chat", "decode"], -5) == 0
    plain = GpuBenchSettings()  # no explicit budgets: the shares as before
    assert section_seconds(plain, ["kernels", "decode"], 60) == pytest.approx(
        60 * SHARES["kernels"] / (SHARES["kernels"] + SHARES["decode"]))


def test_check_options_reach_the_settings_and_bad_ones_are_usage_errors(monkeypatch):
    import benchmarks.gpu.command as command

    seen = {}

    def fake_run(choice, settings, json_path=None, plot_path=None):
        seen["settings"] = settings
        return {"sections": {}}

    monkeypatch.setattr(command, "run_gpu_bench", fake_run)
    out = _invoke(["bench", "gpu", "--shape", "tiny", "--device", "cpu", "--quick", "--budgets",
                   "fidelity=130,decode=120.5", "--prefix-lengths", "30000,1000", "--batch-sizes", "1"])
    assert out.exit_code == 0, out.output
    s = seen["settings"]
    assert s.budgets == {"fidelity": 130.0, "decode": 120.5} and s.prefix_lengths == [1000, 30000]
    assert s.batch_sizes == (1,) and s.record()["budgets"] == {"fidelity": 130.0, "decode": 120.5}
    for args in (["--budgets", "warp=3"], ["--budgets", "chat"], ["--prefix-lengths", "1k"], ["--batch-sizes", "0"]):
        out = _invoke(["bench", "gpu", "--shape", "tiny", "--device", "cpu", *args])
        assert out.exit_code == 2, (args, out.output)


def test_the_json_is_rewritten_after_every_row(tmp_path, one_thread, monkeypatch):
    """A check killed at its time limit keeps every finished row: each chat turn is on disk as it ends."""
    import benchmarks.plots as plots
    from benchmarks.gpu.command import run_gpu_bench
    from benchmarks.gpu.settings import GpuBenchSettings
    from benchmarks.model_options import ModelChoice

    writes: list[int] = []
    real = plots.write_json

    def counting(path, obj):
        writes.append(len(obj["sections"].get("chat", {}).get("samples", [])))
        return real(path, obj)

    monkeypatch.setattr(plots, "write_json", counting)
    settings = GpuBenchSettings.make(quick=True, device_type="cpu", max_prefix=1000, sections=("chat",),
                                     compile_flag=None, time_limit_s=300)
    run_gpu_bench(ModelChoice(shape="tiny", device="cpu"), settings, str(tmp_path / "gpu.json"))
    assert writes[:6] == [1, 2, 3, 4, 5, 6]  # one write per turn, then the section's and the final one
    assert len(json.loads((tmp_path / "gpu.json").read_text())["sections"]["chat"]["samples"]) == 6
