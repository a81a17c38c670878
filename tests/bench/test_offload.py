"""`kvboost bench offload`'s parts that need no model: the llama.cpp peer is driven as `llama-bench` is (its JSON
read, the run's threads, depth and token count passed), and the report's ratios compare the rows they name."""
from __future__ import annotations

import json
import stat

from benchmarks.offload import _llama_cpp, _summarize


def test_the_llama_cpp_row_runs_llama_bench_with_the_run_s_settings(tmp_path):
    seen = tmp_path / "args.json"
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/usr/bin/env python3\nimport json, sys\n"
                    f"open({str(seen)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
                    "print(json.dumps([{'avg_ts': 91.5, 'build_commit': 'abc123', 'flash_attn': False},\n"
                    "                  {'avg_ts': 40.2, 'build_commit': 'abc123', 'flash_attn': True}]))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    row = _llama_cpp(str(fake), "/models/m.gguf", prompt_tokens=1016, new_tokens=64, repeats=3, threads=2)
    assert row["decode_tok_s"] == 91.5 and row["build"] == "abc123"  # its better setting
    assert (row["flash_attn_0"], row["flash_attn_1"]) == (91.5, 40.2)
    args = json.loads(seen.read_text())
    pairs = dict(zip(args[::2], args[1::2]))
    assert pairs == {"-m": "/models/m.gguf", "-t": "2", "-p": "0", "-n": "64", "-d": "1016", "-r": "3",
                     "-fa": "0,1", "-o": "json"}


def test_the_summary_compares_int4_with_the_float_rows_and_llama_cpp():
    def row(system, rate, rss=None, output=(1, 2)):
        return {"system": system, "decode_tok_s": rate, "peak_rss_mb": rss, "output": list(output),
                "kv_dtype": "bfloat16"}

    report = {"rows": [row("float compiled", 50.0, 2500), row("float auto", 40.0, 2000), row("int4 off", 45.0, 800),
                       row("int4 auto, fp32 K/V", 80.0, 1000), row("int4 auto", 100.0, 1000, output=(1, 3)),
                       {"system": "llama.cpp", "decode_tok_s": 80.0}]}
    _summarize(report)
    assert report["int4_over_float_compiled"] == 2.0 and report["int4_rss_over_float"] == 0.5
    assert report["int4_over_llama_cpp"] == 1.25 and report["int4_over_fp32_kv"] == 1.25
    assert report["float_rows_same_tokens"] and not report["int4_rows_same_tokens"]


def test_gpu_only_flags_are_refused_on_the_cpu_rows():
    from typer.testing import CliRunner

    from kvboost.cli import app

    for flags in (["--draft-shape", "qwen2.5-0.5b"], ["--weight-budget-gb", "1"], ["--prefetch-depths", "1,3"]):
        result = CliRunner().invoke(app, ["bench", "offload", *flags])
        assert result.exit_code == 2 and "are GPU rows (--device cuda)" in result.output, result.output
    result = CliRunner().invoke(app, ["bench", "offload", "--device", "cuda", "--shape", "tiny", "--draft-shape", "x"])
    assert result.exit_code == 2 and "unknown shape 'x'" in result.output, result.output
