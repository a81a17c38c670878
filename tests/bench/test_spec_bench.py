"""`kvboost bench spec` aggregation: rates over all decode tokens / all decode time, ratios against KVBoost
without speculation, acceptance only where drafts were proposed."""
from __future__ import annotations

from benchmarks.spec import Sample, _rows
from benchmarks.workloads import load_spec_tasks


def test_rows_aggregate_per_workload_against_no_speculation():
    samples = [Sample("rag", "kvboost", 11, 2.0, True), Sample("rag", "kvboost", 21, 2.0, True),
               Sample("rag", "prompt_lookup", 11, 1.0, True, 8, 6),
               Sample("rag", "prompt_lookup", 21, 1.0, False, 8, 2),
               Sample("rag", "draft", 11, 4.0, True, 4, 0), Sample("rag", "draft", 21, 4.0, True, 4, 0),
               Sample("rag", "hf_prompt_lookup", 11, 2.0, True), Sample("rag", "hf_prompt_lookup", 21, 2.0, True)]
    rows = {r.system: r for r in _rows(samples)}
    assert rows["kvboost"].decode_tok_s == 30 / 4 and rows["kvboost"].speedup == 1.0
    assert rows["prompt_lookup"].speedup == 2.0 and rows["prompt_lookup"].acceptance == 0.5
    assert rows["prompt_lookup"].identical_rate == 0.5
    assert rows["draft"].speedup == 0.5 and rows["draft"].acceptance == 0.0
    assert rows["hf_prompt_lookup"].acceptance is None


def test_shipped_tasks_cover_every_workload():
    tasks = load_spec_tasks()
    assert {t["workload"] for t in tasks} == {"rag", "code", "extract", "chat"}
    assert all(t["messages"][-1]["role"] == "user" for t in tasks)


def test_a_run_on_a_shape_reports_rows_and_the_measured_step_costs(tmp_path, one_thread):
    import json

    from benchmarks.model_options import model_choice
    from benchmarks.spec import run_spec_bench

    js = tmp_path / "spec.json"
    rows = run_spec_bench(model_choice(None, "tiny", "cpu", None), max_new_tokens=6, per_workload=1, k=4,
                          json_path=str(js), min_ngram=1, max_ngram=4)
    assert {(r.workload, r.system) for r in rows} == {(w, s) for w in ("rag", "code", "extract", "chat")
                                                     for s in ("kvboost", "prompt_lookup", "draft", "hf_prompt_lookup")}
    assert all(r.identical_rate == 1.0 for r in rows)  # greedy: every system's tokens equal no speculation's
    data = json.loads(js.read_text())
    assert data["prompt_lookup_ngram"] == [1, 4]  # the engine ran with the n-grams asked for
    assert data["fast_path"]["mode"] == "off"  # the engine's default on a CPU (auto), recorded with its reason
    assert set(data["step_costs"]) == {"rag", "code", "extract", "chat"}
    last = data["step_costs"]["chat"]
    assert set(last) <= {"prompt_lookup", "draft"} and last  # what the engine measured, per method
    for costs in last.values():
        assert costs["plain_step_ms"] > 0 and set(costs["verify_ms"]) == {str(n) for n in range(2, 17)}


def test_batch_runner_rows_are_identical_and_draft(one_thread):
    """--batch-runner: each prompt also runs as a lone row of the batching runner, and a workload's prompts run
    together as rows of one batch, with and without lookup."""
    from benchmarks.model_options import model_choice
    from benchmarks.spec import TOGETHER_COPIES, TOGETHER_ROUNDS, run_spec_bench

    rows = run_spec_bench(model_choice(None, "tiny", "cpu", None), max_new_tokens=12, per_workload=2, k=4,
                          min_ngram=1, batch_runner=True)
    batched = [r for r in rows if r.system.startswith(("batched", "together"))]
    assert {r.system for r in batched} == {"batched", "batched_prompt_lookup", "together", "together_prompt_lookup"}
    assert len(batched) == 16
    together = 2 * TOGETHER_COPIES * TOGETHER_ROUNDS  # samples: prompts x copies queued x rounds
    assert all(r.prompts == (together if r.system.startswith("together") else 2) for r in batched)
    assert all(r.identical_rate == 1.0 for r in batched)
    for system in ("batched", "together"):
        assert all(s["draft_tokens"] == 0 for r in batched if r.system == system for s in r.samples)
        assert sum(s["draft_tokens"] for r in batched if r.system == f"{system}_prompt_lookup" for s in r.samples)


def test_a_fast_path_that_does_not_exist_is_a_usage_error():
    from typer.testing import CliRunner

    from kvboost.cli import app

    out = CliRunner().invoke(app, ["bench", "spec", "--fast-path", "turbo"], env={"COLUMNS": "200"})
    assert out.exit_code == 2 and "expected one of auto, graphs, compiled, eager, off" in out.output
