"""The fidelity section of `kvboost bench gpu`: its workload, comparisons, totals, report lines, and the per-step
agreement with an fp32 copy (agreement.py) on hand-built distributions and a tiny model whose fp32 argmax is known
(tests/bench/test_gpu_bench.py runs the section end to end)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from benchmarks.gpu.agreement import NEAR_TIE_NATS, Tally, duel, merge, score_steps, teacher_logprobs
from benchmarks.gpu.command import fidelity_measured
from benchmarks.gpu.fidelity import (
    ARCHS,
    PREFIX_STEP,
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


def test_workload_alternates_prefixes_of_different_lengths(tokenizer):
    w = fidelity_workload(tokenizer, 700, 36, prefixes=2)
    assert [len(p) for p in w.prefixes] == [700, 700 + PREFIX_STEP] and w.prefix == w.prefixes[0]
    assert w.prefixes[0] != w.prefixes[1][:700]  # drawn, not extended
    assert [w.prefix_of(i) for i in range(4)] == [0, 1, 0, 1]
    fewer = fidelity_workload(tokenizer, 700, 24, prefixes=2)  # the bench model's share: the same first questions
    assert fewer.prefixes == w.prefixes and fewer.questions == w.questions[:24]


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


def _lp(rows: list[list[float]]) -> torch.Tensor:
    """Log-probs whose values are the given ones up to a per-row constant (log_softmax of them)."""
    return torch.log_softmax(torch.tensor(rows, dtype=torch.float64), dim=-1).float()


def test_steps_are_scored_against_the_fp32_argmax_by_hand():
    # step 0: argmax 1, runner-up 2 by 0.05 nats; step 1: argmax 3 by 2 nats; step 2: argmax 0 by 0.5 over 4
    lp = _lp([[0.0, 3.0, 2.95, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0, 0.0], [1.5, 0.0, 0.0, 0.0, 1.0]])
    steps = score_steps(lp, [2, 3, 4])  # near-tie miss, hit, clear miss
    assert steps.argmax == [1, 3, 0]
    assert steps.gap == pytest.approx([0.05, 2.0, 0.5], abs=1e-5)
    assert steps.deficits == pytest.approx([0.05, 0.0, 0.5], abs=1e-5)
    tally = Tally()
    tally.add(steps, [2, 3, 4])
    s = tally.summary()
    assert (s["steps"], s["fp32_argmax"], s["off_argmax"], s["off_argmax_near_tie"]) == (3, 1, 2, 1)
    assert s["near_tie_steps"] == 1  # only step 0's gap is under NEAR_TIE_NATS
    assert s["deficit"]["max"] == pytest.approx(0.5, abs=1e-5) and s["deficits"] == pytest.approx([0.05, 0.5], abs=1e-4)
    assert 0.05 < NEAR_TIE_NATS < 0.5
    # the duel at step 0 (same history): the system took 2, the reference 1, which fp32 prefers by 0.05
    d = duel(lp, [2, 3, 4], [1, 3, 4], first_divergence([1, 3, 4], [2, 3, 4]))
    assert d.system < d.reference and d.margin == pytest.approx(0.05, abs=1e-5)
    assert duel(lp, [1, 3], [1, 3, 4], 2) is None  # ended (EOS) where the reference went on: no duel
    tally.duels.append(d)
    tally.duels.append(duel(lp, [1, 3, 0], [1, 3, 4], 2))  # won by 0.5
    s = tally.summary()["duels"]
    assert (s["n"], s["won"], s["lost"], s["even"], s["near_tie"]) == (2, 1, 1, 0, 1)
    total = merge([tally.summary(), tally.summary()])
    assert (total["steps"], total["fp32_argmax"], total["off_argmax"], total["duels"]["won"]) == (6, 2, 4, 2)


class _NextToken(torch.nn.Module):
    """A "model" whose fp32 argmax after token t is (t + 1) % V, by 1 nat over t + 2: the argmax of every step
    is known, so a scorer that reads the wrong position fails."""

    V = 11

    def __init__(self):
        super().__init__()
        table = torch.zeros(self.V, self.V)
        for t in range(self.V):
            table[t, (t + 1) % self.V], table[t, (t + 2) % self.V] = 2.0, 1.0
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids, logits_to_keep=0, **_):
        logits = self.table[input_ids]
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def test_teacher_forcing_scores_each_step_after_its_own_history():
    teacher = _NextToken()
    prompt = [3, 9]
    lp = teacher_logprobs(teacher, prompt, [10, 0, 2, 4])  # after 9 -> 10, 10 -> 0, 0 -> 1 (not 2), 2 -> 3 (not 4)
    steps = score_steps(lp, [10, 0, 2, 4])
    assert steps.argmax == [10, 0, 1, 3]
    assert steps.deficits == pytest.approx([0.0, 0.0, 1.0, 1.0], abs=1e-5)
    tally = Tally()
    tally.add(steps, [10, 0, 2, 4])
    assert (tally.steps, tally.argmax, len(tally.deficits)) == (4, 2, 2)
    assert teacher_logprobs(teacher, prompt, []).numel() == 0


def test_teacher_over_a_cropped_prefix_cache_is_a_full_forward(tokenizer, one_thread):
    from tests.tiny_models import make_tiny_model

    model = make_tiny_model("llama", tokenizer, device=torch.device("cpu"))
    prefix, question, tokens = list(range(100, 140)), [7, 8, 9], [11, 12, 13, 14]
    with torch.inference_mode():
        cache = model(torch.tensor([prefix]), use_cache=True).past_key_values
        full = teacher_logprobs(model, prefix + question, tokens)
        for _ in range(2):  # cropped back each time: the second pass sees the prefix alone again
            cached = teacher_logprobs(model, question, tokens, cache, len(prefix))
            assert cache.get_seq_length() == len(prefix)
            torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)
        # the model's own greedy continuation is the fp32 argmax at every step; swapping step 2 for its runner-up
        # leaves the argmax at that step alone, by exactly that step's top-2 gap
        greedy = model.generate(torch.tensor([prefix + question]), max_new_tokens=6, do_sample=False,
                                pad_token_id=0, eos_token_id=None)[0, len(prefix) + len(question):].tolist()
        steps = score_steps(teacher_logprobs(model, question, greedy, cache, len(prefix)), greedy)
        assert steps.argmax == greedy and max(steps.deficits) == 0.0
        runner_up = torch.topk(teacher_logprobs(model, question, greedy, cache, len(prefix))[2], 2).indices[1]
        swapped = greedy[:2] + [int(runner_up)]
        steps = score_steps(teacher_logprobs(model, question, swapped, cache, len(prefix)), swapped)
        assert steps.argmax == greedy[:3]
        assert steps.deficits[:2] == [0.0, 0.0] and math.isclose(steps.deficits[2], steps.gap[2], abs_tol=1e-6)


def test_totals_merge_the_fp32_steps_per_dtype():
    tally = Tally()
    tally.add(score_steps(_lp([[0.0, 1.0], [2.0, 0.0]]), [1, 1]), [1, 1])
    tally.duels.append(duel(_lp([[0.0, 1.0], [2.0, 0.0]]), [1, 1], [1, 0], 1))
    scored = {"reference": tally.summary(), "recipe": tally.summary(), "kvboost": tally.summary()}
    rows = [_row("llama", "bfloat16", 12, 11, 10) | {"fp32_steps": scored},
            _row("qwen2.5-3b", "bfloat16", 12, 12, 12) | {"fp32_steps": scored}]
    totals = fidelity_totals(rows)["bfloat16"]
    assert totals["questions"] == 24 and totals["fp32_steps"]["kvboost"]["steps"] == 4
    assert totals["fp32_steps"]["kvboost"]["fp32_argmax"] == 2 and totals["fp32_steps"]["kvboost"]["duels"]["lost"] == 2
    measured = fidelity_measured({"totals": fidelity_totals(rows)})
    assert measured["fidelity_bf16_kvboost_fp32_argmax"] == "2/4"
    assert measured["fidelity_bf16_kvboost_duels"] == "0-2 (0 near-tie)"


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
