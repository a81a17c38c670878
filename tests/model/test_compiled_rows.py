"""fast_path="compiled" and batches (model/runner.py, the "rows" step): a batch runner's decode step compiles once
per model, one graph for every row count, and decodes the tokens each prompt gets alone."""
from __future__ import annotations

import pytest
import torch

from kvboost import KVBoost

from ..tiny_models import make_tiny_model
from .compiled_engines import plain_and_compiled

PROMPTS = ["Tell me a story about a fox " * 1, "Tell me a story about a fox " * 3, "hi",
           "Essay: words and more words " * 20, "Copy this: the quick brown fox jumps over the lazy dog. " * 4]


def _unique_graphs() -> int:
    import torch._dynamo.utils

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_batches_decode_through_one_compiled_rows_graph(tokenizer, device):
    plain, fast = plain_and_compiled(tokenizer, device)
    assert fast.cache_stats()["fast_path"]["compiled_steps"] == ["decode", "rows"]
    if fast.runner.decode_kernels.startswith("packed"):  # the packed kernels read their own copy: the eager
        # forwards' products keep nn.Linear's order (W @ x^T over input-major weights ran 4-15x slower)
        assert "over packed GEMV kernels" in fast.cache_stats()["fast_path"]["reason"]
        assert all(m.weight.is_contiguous() for m in fast.model.modules() if isinstance(m, torch.nn.Linear))
    want = [plain.generate(p, max_new_tokens=12).output_token_ids for p in PROMPTS]
    graphs = _unique_graphs()
    for picked in ([0, 1, 3], [0, 1, 2, 3, 4], [3], [1, 4]):  # a batch runner each: 3, 5 (bucket 8), 1 and 2 rows
        got = fast.generate_batch([PROMPTS[i] for i in picked], max_new_tokens=12)
        assert [r.output_token_ids for r in got] == [want[i] for i in picked], picked
        assert _unique_graphs() - graphs == 1  # the first batch compiled it; no row count compiles again
    assert "compile_refusals" not in fast.cache_stats()["fast_path"]


def test_a_lone_row_runs_beside_a_free_slot(tokenizer, device):
    """torch specializes a size of 1, so a 1-row step would be another graph: a compiled runner's smallest batched
    step is 2 rows, and the engine's workspace has at least 2 rows once rows run together (a lone row runs the
    single-row decode step)."""
    _, fast = plain_and_compiled(tokenizer, device)
    assert fast.runner.least_rows == 2
    fast.generate("river stone", 3)
    assert fast.kv_workspace.batch_size == 1  # alone: no second row was needed
    handles = [fast.submit(fast.request(p, 3)) for p in ("river stone", "quiet orbit lantern")]
    while not all(h.finished for h in handles):
        fast.step()
    assert fast.kv_workspace.batch_size == 2
    eager = KVBoost(make_tiny_model("llama", tokenizer, device=device), tokenizer, fast_path="eager")
    assert eager.runner.least_rows == 1


def test_a_rows_step_dynamo_refuses_runs_eagerly_and_the_engine_says_so(tokenizer, device):
    """At recompile_limit 1 the engine's decode step takes the model's one graph; a batch's rows step is then
    refused: it runs eagerly with the same tokens, and the engine's cache_stats() reports it (the batch runner's
    steps report to the engine's runner)."""
    if device.type != "cpu":
        pytest.skip("fast_path='compiled' is the CPU path (CUDA runs graphs)")
    with torch._dynamo.config.patch(recompile_limit=1):
        plain, fast = plain_and_compiled(tokenizer, device)
        want = [plain.generate(p, max_new_tokens=8).output_token_ids for p in PROMPTS[:3]]
        got = fast.generate_batch(PROMPTS[:3], max_new_tokens=8)
        assert [r.output_token_ids for r in got] == want
        stats = fast.cache_stats()["fast_path"]
        assert stats["compiled_steps"] == ["decode"] and stats["compile_refusals"] == 1
        assert stats["failure"].startswith("rows steps run eagerly")
        assert fast.generate(PROMPTS[0], max_new_tokens=8).output_token_ids == want[0]  # decode still compiled
