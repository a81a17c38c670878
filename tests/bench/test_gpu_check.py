"""scripts/gpu_check.sh's pieces on a CPU: the smoke marker, tests.txt, the summary, and the script itself end to end
(a cheap rehearsal: two device tests, one bench section on the tiny shape)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.gpu.check import junit_report, main, progress_counts, summary_text
from tests.gpu_smoke import GPU_SMOKE, is_gpu_smoke

ROOT = Path(__file__).resolve().parents[2]


def test_every_smoke_file_exists_holds_tests_and_says_why():
    assert len(GPU_SMOKE) >= 10
    for path, why in GPU_SMOKE.items():
        assert (ROOT / path).is_file(), f"{path} is listed in tests/gpu_smoke.py but gone"
        assert "def test_" in (ROOT / path).read_text(), path
        assert len(why) > 20, path
    assert is_gpu_smoke("tests/model/test_graphs.py") and not is_gpu_smoke("tests/bench/test_gpu_check.py")


def test_collection_marks_the_listed_files_only():
    import pytest as _pytest

    from tests.conftest import pytest_collection_modifyitems

    class Item:
        def __init__(self, path):
            self.path, self.markers = path, []

        def add_marker(self, marker):
            self.markers.append(marker.name)

    items = [Item(ROOT / "tests/model/test_runner.py"), Item(ROOT / "tests/test_cli.py"), Item(Path("/elsewhere.py"))]
    pytest_collection_modifyitems(SimpleNamespace(rootpath=ROOT), items)
    assert [i.markers for i in items] == [["gpu_smoke"], [], []]
    assert _pytest.mark.gpu_smoke.name == "gpu_smoke"


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="1"
skipped="2" tests="10"><testcase classname="tests.model.test_runner" name="test_a"/>
<testcase classname="tests.model.test_runner" name="test_b"><failure message="AssertionError: 1 != 2">tb</failure>
</testcase><testcase classname="tests.model.test_runner" name="test_c"><error message="">RuntimeError: CUDA boom
more</error></testcase></testsuite></testsuites>"""


JUNIT_OK = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="0"
skipped="2" tests="10"><testcase classname="tests.model.test_runner" name="test_a"/></testsuite></testsuites>"""


def test_junit_report_counts_and_names_each_failure(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # test ids are resolved against the repository's files
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    text, ok = junit_report(str(junit), str(tmp_path / "none.log"), 1, 61.4, 120)
    lines = text.splitlines()
    assert lines[0] == "tests: 6 passed, 1 failed, 1 errors, 2 skipped in 61 s" and not ok
    assert "FAIL tests/model/test_runner.py::test_b" in text and "AssertionError: 1 != 2" in text
    assert "ERROR tests/model/test_runner.py::test_c" in text and "RuntimeError: CUDA boom" in text
    junit.write_text(JUNIT_OK)
    text, ok = junit_report(str(junit), "", 0, 10, 120)
    assert ok and text.startswith("tests: 8 passed, 0 failed, 0 errors, 2 skipped in 10 s\n")


def test_a_run_cut_at_its_cap_is_counted_from_the_progress_line_and_fails(tmp_path):
    log = tmp_path / "pytest.log"
    log.write_text("..........F..s.x [ 50%]\n....E.\nsome traceback line\n!!! KeyboardInterrupt !!!\n")
    assert progress_counts(str(log)) == {"passed": 18, "failed": 1, "errors": 1, "skipped": 2}
    text, ok = junit_report(str(tmp_path / "absent.xml"), str(log), 124, 121, 120)
    assert not ok and text.startswith("tests: 18 passed, 1 failed, 1 errors, 2 skipped in 121 s (stopped at its "
                                      "120 s cap")
    assert "progress line" in text and "KeyboardInterrupt" in text  # the log's tail comes along


def _report() -> dict:
    steps = {"steps": 100, "fp32_argmax": 97, "off_argmax": 3, "off_argmax_near_tie": 2, "near_tie_steps": 9,
             "deficit": {"max": 0.3}, "deficits": [0.01, 0.02, 0.3]}
    kvb = steps | {"duels": {"n": 5, "won": 2, "lost": 3, "even": 0, "near_tie": 4, "margin": {"max": 0.3}}}
    row = {"model": "qwen2.5-3b", "dtype": "bfloat16", "questions": 24, "kvboost_identical": 10,
           "recipe_identical": 12, "fp32_steps": {"reference": steps, "recipe": steps, "kvboost": kvb}}
    return {"model": "shape qwen2.5-3b (random weights)", "dtype": "bfloat16", "device": "cuda:0", "complete": True,
            "machine": {"gpu": {"name": "NVIDIA H100 80GB HBM3"}, "torch": "2.11.0+cu130", "transformers": "5.17.0"},
            "sections": {
                "fidelity": {"status": "ok", "wall_s": 100, "budget_s": 130, "rows": [row], "totals": {
                    "bfloat16": {"questions": 96, "kvboost_identical": 60, "recipe_identical": 70,
                                 "kvboost_equals_recipe": 50, "fp32_steps": {"reference": steps, "kvboost": kvb}}}},
                "chat": {"status": "ok", "samples": [{}] * 24, "from_turn2": {
                    "kvboost_p50_ms": 12.5, "kvboost_p99_ms": 18.4, "plain_p50_ms": 149.0, "plain_p99_ms": 270.0,
                    "manual_p50_ms": 150.0, "manual_p99_ms": 3000.0}},
                "prefix": {"status": "ok", "rows": [
                    {"prefix_tokens": 1000, "kvboost_over_floor": 0.08, "store_over_floor": 0.11,
                     "host_over_floor": 1.3, "floor_ms": 54.0},
                    {"prefix_tokens": 30000, "kvboost_over_floor": 0.19, "store_over_floor": 0.42,
                     "host_error": "boom", "floor_ms": 58.0}]},
                "decode": {"status": "ok", "rows": [
                    {"system": "kvboost", "batch": 1, "status": "ok", "decode_tok_s": 251.0},
                    {"system": "hf eager", "batch": 1, "status": "ok", "decode_tok_s": 40.0},
                    {"system": "hf static+compile", "batch": 1, "status": "ok", "decode_tok_s": 180.0,
                     "compile_s": 65.0}]}}}


def test_the_summary_shows_the_rows_a_reader_compares(tmp_path):
    (tmp_path / "gpu.json").write_text(json.dumps(_report()))
    (tmp_path / "tests.txt").write_text("tests: 352 passed, 0 failed, 0 errors, 13 skipped in 98 s\nmore\n")
    text = summary_text(tmp_path, ["tests 98 s (ok)", "bench 340 s (ok)"])
    assert text.startswith("== kvboost GPU check on cuda:0: NVIDIA H100 80GB HBM3, torch 2.11.0+cu130")
    assert "352 passed, 0 failed, 0 errors, 13 skipped in 98 s" in text
    assert "identical KVB 60/96, recipe 70/96 | fp32-argmax steps HF 97.0%, KVB 97.0%" in text
    assert "KVB off-argmax 2/3 near-tie; duels KVB-HF 2-3 (4 near-tie)" in text
    assert "qwen2.5-3b bf16" in text and "identical KVB 10/24" in text
    assert "KVB p50 12.5 ms, p99 18.4 ms" in text
    assert "KVB 251.0 tok/s | HF static+compile 180.0 tok/s (compile 65 s) | HF eager 40.0 tok/s" in text
    assert "prefix 1,000 KVB/floor" in text and "resident 0.08, from store 0.11, host tier 1.30" in text
    assert "resident 0.19, from store 0.42, host tier error" in text
    assert "steps" in text and "bench 340 s (ok)" in text
    assert len(text.splitlines()) <= 25  # one screen


def test_the_summary_of_an_empty_folder_still_prints(tmp_path, capsys):
    assert main(["summary", str(tmp_path), "--step=tests=0:skipped"]) == 0
    assert (tmp_path / "summary.txt").read_text() == capsys.readouterr().out
    assert "tests 0 s (skipped)" in (tmp_path / "summary.txt").read_text()


@pytest.mark.skipif(sys.platform != "linux", reason="bash and coreutils' timeout")
def test_the_cpu_rehearsal_runs_end_to_end(tmp_path):
    """KVBOOST_GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh, cut to seconds: two device tests and the chat
    section on the tiny shape; the same files as on a GPU, and the summary printed last."""
    env = dict(os.environ, KVBOOST_GPU_CHECK_DEVICE="cpu", KVBOOST_GPU_CHECK_OUT=str(tmp_path), PYTHON=sys.executable,
               KVBOOST_GPU_CHECK_BENCH="--quick --shape tiny --sections chat --batch-sizes 1",
               OMP_NUM_THREADS="1")
    command = ["bash", "scripts/gpu_check.sh", "tests/test_devices.py", "-k", "same_device or assert_on"]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.json", "summary.txt", "tests.txt"]  # no failures
    summary = (tmp_path / "summary.txt").read_text()
    assert out.stdout.rstrip().endswith(summary.rstrip())
    assert "tests (gpu_smoke)" in summary and " passed, 0 failed, 0 errors" in summary
    assert "chat TTFT from turn 2" in summary and "total " in summary and "(ok)" in summary
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["complete"] and report["sections"]["chat"]["status"] == "ok"


def test_the_summary_has_a_line_for_the_offload_rows():
    from benchmarks.gpu.check import offload_lines

    assert offload_lines(None) == []
    report = {"rows": [{"system": "int4 tinygemm", "status": "ok", "decode_tok_s": 232.27, "peak_device_mb": 2440.7},
                       {"system": "hf device_map auto", "status": "error", "reason": "RuntimeError: out of memory"}]}
    [(label, text)] = offload_lines(report)
    assert label == "offload (INT4)"
    assert text == "int4 tinygemm 232.3 tok/s, 2,441 MB | hf device_map auto error: RuntimeError: out of memory"
