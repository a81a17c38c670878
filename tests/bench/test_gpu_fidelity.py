"""The fidelity section of `kvboost bench gpu`: its workload, comparisons, totals and report lines (no models
here; tests/bench/test_gpu_bench.py runs the section end to end)."""
from __future__ import annotations

import pytest
import torch

from benchmarks.gpu.command import fidelity_measured
from benchmarks.gpu.fidelity import (
    ARCHS,
    fidelity_config,
    fidelity_totals,
    fidelity_workload,
    first_divergence,
    run_fidelity,
    until_eos,
)
from benchmarks.gpu.settings import GpuBenchSettings
from benchmarks.gpu.timing import Budget
from benchmarks.gpu.view import fidelity_table, targets_line


def test_workload_is_deterministic_and_free_of_special_ids(tokenizer):
    a = fidelity_workload(tokenizer, 700, 12, avoid=[5])
    assert a == fidelity_workload(tokenizer, 700, 12, avoid=[5])
    assert len(a.prefix) == 700 and len(a.questions) == 12
    assert all(10 <= len(q) <= 30 for q in a.questions) and len({len(q) for q in a.questions[:2]}) == 2
    banned = set(tokenizer.all_special_ids) | {5}
    assert not banned & set(a.prefix + [t for q in a.questions for t in q])
    assert max(a.prefix) < len(tokenizer)


@pytest.mark.parametrize("arch", ARCHS)
def test_configs_share_the_tokenizer_vocabulary_and_special_ids(arch, tokenizer):
    cfg = fidelity_config(arch, tokenizer)
    assert cfg.vocab_size == len(tokenizer) and cfg.eos_token_id == tokenizer.eos_token_id
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (256, 4, 8, 2)
    assert getattr(cfg, "sliding_window", None) is None


def test_continuations_are_cut_at_eos_and_compared_step_by_step():
    assert until_eos([5, 6, 2, 7], {2}) == [5, 6] and until_eos([5, 6], {2}) == [5, 6]
    assert first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # stopped early (EOS): differs where it stopped
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def _row(model: str, dtype: str, q: int, kvb: int, recipe: int) -> dict:
    return {"model": model, "dtype": dtype, "status": "ok", "questions": q, "kvboost_identical": kvb,
            "recipe_identical": recipe, "kvboost_equals_recipe": min(kvb, recipe), "kvboost_first_divergence_mean":
            None if kvb == q else 7.0, "recipe_first_divergence_mean": None, "kvboost_cached_mean": 700.0,
            "attention": "triton"}


def test_totals_and_measured_counts_per_dtype():
    rows = [_row("llama", "bfloat16", 12, 11, 10), _row("mistral", "bfloat16", 12, 11, 12),
            _row("llama", "float32", 12, 12, 12), _row("mistral", "float32", 12, 12, 12)]
    section = {"status": "ok", "rows": rows, "totals": fidelity_totals(rows), "new_tokens": 24, "prefix_tokens": 700}
    assert section["totals"]["bfloat16"] == {"questions": 24, "kvboost_identical": 22, "recipe_identical": 22,
                                             "kvboost_equals_recipe": 21}
    measured = fidelity_measured(section)
    assert measured == {"fidelity_bf16_kvboost": "22/24", "fidelity_bf16_recipe": "22/24", "fidelity_bf16_met": True,
                        "fidelity_fp32_kvboost": "24/24", "fidelity_fp32_recipe": "24/24", "fidelity_fp32_met": True}
    rows[2]["kvboost_identical"] = 11
    assert not fidelity_measured({"totals": fidelity_totals(rows)})["fidelity_fp32_met"]
    assert fidelity_measured({"status": "error"}) == {}
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(fidelity_table(section))
    text = console.export_text()
    assert "22/24" in text and "11/12" in text and "700-token" in text
    assert "fp32 KVBoost 24/24" in targets_line({"measured": measured, "targets": {}})


def test_a_spent_budget_stops_before_building_anything(tokenizer):
    class Engine:  # the section reads only these from the bench's engine
        device = torch.device("cpu")
        eos_token_ids = {tokenizer.eos_token_id}

    Engine.tokenizer = tokenizer
    settings = GpuBenchSettings.make(quick=True, device_type="cpu", max_prefix=1000, sections=("fidelity",),
                                     compile_flag=None, time_limit_s=1.0)
    section = run_fidelity(Engine(), settings, Budget(0.0), lambda s: None)
    assert section["status"] == "truncated" and section["rows"] == [] and section["reason"]
    assert (section["prefix_tokens"], section["questions"], section["new_tokens"]) == (160, 2, 8)
