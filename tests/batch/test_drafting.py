"""The width of a busy batch's ragged verify (batch/drafting.py), and the mask each attention takes for it."""
from __future__ import annotations

import pytest

from kvboost import KVBoost
from kvboost.batch.drafting import REPROBE_STEPS, RETRY_SHARE, BatchDrafting, RowDrafts
from kvboost.batch.forwards import ragged_mask_kind
from kvboost.decoding.speculative import PROBE_K, AdaptiveK
from kvboost.scheduler import Scheduler

from ..tiny_models import make_tiny_model


def _row(drafts: int, kept: float = 8.0, rejected: float = 0.5) -> RowDrafts:
    adaptive = AdaptiveK(15)
    adaptive.kept, adaptive.rejected = kept, rejected
    return RowDrafts(list(range(drafts)), adaptive)


def _measured(plain_s: float = 0.1, verify: dict[int, float] | None = None, rows: int = 2) -> BatchDrafting:
    d = BatchDrafting()
    d.timed_plain(rows, plain_s)
    for total, seconds in (verify or {}).items():
        for _ in range(2):
            d.record_verify(total, seconds)
    return d


def test_expected_tokens_per_width():
    row = _row(3, kept=1, rejected=1)  # acceptance 1/2, three drafts
    assert row.expected_by_width(6) == pytest.approx([1, 1, 1.5, 1.75, 1.875, 1.875, 1.875])
    assert [row.expected_by_width(w)[w] for w in (1, 2, 4, 6)] == pytest.approx([1, 1.5, 1.875, 1.875])
    assert RowDrafts([5, 6]).expected_by_width(3) == [1, 1, 1, 1]  # a row that does not speculate


def test_plain_until_the_plain_step_is_measured_then_a_probe():
    d = BatchDrafting()
    proposals = [_row(8), _row(0)]
    assert not d.proposing(2)  # the yardstick first
    assert d.width(proposals, 100) == 1
    d.timed_plain(2, 0.1)
    assert d.proposing(2) and not d.proposing(3)  # per row count
    assert d.width(proposals, 100) == PROBE_K + 1  # a verify's cost is unknown: a few drafts
    assert d.width([RowDrafts([]), RowDrafts([])], 100) == 1  # nothing proposed: nothing to verify


def test_the_width_maximizes_tokens_per_second():
    # Verifies cost what a plain step does up to 8 tokens in all, twice that above: at an acceptance of 1/2,
    # 2 rows x 4 wins; near-certain drafts are worth the dearer full width.
    d = _measured(0.1, {4: 0.1, 6: 0.1, 8: 0.1, 10: 0.2, 16: 0.2, 32: 0.2})
    assert d.width([_row(15, kept=1, rejected=1), _row(15, kept=1, rejected=1)], 100) == 4
    assert d.width([_row(15), _row(15)], 100) == 16
    # Costs flat everywhere: as wide as the longest proposal, and never past the room left.
    d = _measured(0.1, {4: 0.1, 32: 0.1})
    assert d.width([_row(15), _row(6)], 100) == 16
    assert d.width([_row(15), _row(6)], 5) == 5
    assert d.width([_row(3), _row(0)], 100) == 4


def test_a_wide_step_is_not_guessed_cheap_before_its_cost_is_known():
    """One verify timed (4 rows x 3 = 12 tokens): wider steps are taken to cost in proportion to their tokens, so
    rows that keep about half their drafts stay narrow instead of jumping to the widest."""
    d = _measured(0.05, {12: 0.09}, rows=4)
    rows = [_row(15, kept=1, rejected=1) for _ in range(4)]
    assert d.verify_cost(24) == pytest.approx(0.18) and d.verify_cost(8) == pytest.approx(0.09)
    assert d.width(rows, 100) <= 3


def test_a_width_timed_once_slowly_is_not_ruled_out():
    """Its first run captured a graph (10x its real cost): until timed again it costs no more than the totals
    below it say, so it can be chosen again and its real time count."""
    d = _measured(0.05, {8: 0.06}, rows=4)
    d.record_verify(16, 0.6)
    assert d.verify_cost(16) == pytest.approx(0.12)
    d.record_verify(16, 0.07)
    assert d.verify_cost(16) == pytest.approx(0.07)  # the better of its first two timings


def test_drafts_that_do_not_pay_pause_then_retry_one():
    d = _measured(0.1, {4: 0.11, 6: 0.16, 32: 0.8})  # a verify costs about half a plain step per token
    bad = [_row(8, kept=0.1, rejected=5.0), _row(8, kept=0.1, rejected=5.0)]
    assert d.proposing(2) and d.width(bad, 100) == 1  # loses: a pause...
    assert [d.proposing(2) for _ in range(5)] == [False] * 4 + [True]
    assert d.width(bad, 100) == 2  # ...then one draft each, to re-measure
    assert d.width(bad, 100) == 1 and d.wait == 8  # still losing: the pause doubles
    d.timed_verify(2, 2, 0.11, kept_whole=True)
    assert d.pause == 4 and d.verifies == 1
    # Where a retry costs much more than a plain step, the pause starts long: retries stay under RETRY_SHARE.
    d = _measured(0.1, {4: 0.25, 32: 0.4})
    assert d.width(bad, 100) == 1 and d.wait == 50  # 0.15 s extra per retry / (3% of 0.1 s)


def test_retries_stay_a_small_share_where_a_verify_costs_several_plain_steps():
    """A GPU: plain steps replay as graphs (12 ms), a ragged verify runs eagerly (~48 ms). Rows that keep few drafts
    pause long enough that one 2-wide retry per pause costs at most RETRY_SHARE of the decode time."""
    d = _measured(0.012, {8: 0.048, 12: 0.05, 64: 0.06}, rows=4)
    bad = [_row(8, kept=0.1, rejected=5.0) for _ in range(4)]
    steps = retries = 0
    while steps < 10_000:
        steps += 1
        if d.proposing(4) and d.width(bad, 100) > 1:
            retries += 1
    assert retries * (0.048 - 0.012) <= RETRY_SHARE * steps * 0.012 * 1.1  # (the first pauses are short)


def test_where_no_verify_can_pay_rows_do_not_propose_but_a_probe_comes_back():
    """A verify costs more per token than a plain step of the batch (many rows on a CPU): even drafts all kept
    cannot pay. Rows skip proposing; one probe per REPROBE_STEPS re-measures."""
    d = _measured(0.05, {8: 0.11, 16: 0.21, 64: 0.81}, rows=4)
    assert d.hopeless(4)
    asked = [d.proposing(4) for _ in range(2 * REPROBE_STEPS)]
    assert asked.count(True) == 2 and asked[REPROBE_STEPS - 1]
    assert d.width([_row(8) for _ in range(4)], 100) == PROBE_K + 1  # the probe
    d.record_verify(64, 0.01)
    d.record_verify(64, 0.01)  # the verify got cheap (a kernel warmed up, a longer context): drafting pays again
    assert not d.hopeless(4) and d.proposing(4)


def test_the_mask_each_attention_takes(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    assert ragged_mask_kind(KVBoost(model, tokenizer)) == "bool"  # KVBoost's attention (sdpa on CPU)
    own = KVBoost(model, tokenizer, attention_backend="model")
    model.config._attn_implementation = "eager"
    assert ragged_mask_kind(own) == "additive"
    model.config._attn_implementation = "flash_attention_2"
    assert ragged_mask_kind(own) is None
    model.config._attn_implementation = "sdpa"
    assert ragged_mask_kind(own) == "bool"


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_ragged_steps_through_the_models_own_attention_equal_plain_generation(tokenizer, implementation):
    """attention_backend="model": eager attention adds the mask (0 / dtype min), sdpa takes it as booleans."""
    model = make_tiny_model("llama", tokenizer)
    model.config._attn_implementation = implementation
    plain = KVBoost(model, tokenizer, chunk_size=16, attention_backend="model")
    spec = KVBoost(model, tokenizer, chunk_size=16, attention_backend="model", speculative="prompt_lookup")
    prompts = ["river stone lantern quiet orbit " * 6, "orbit quiet river lantern stone " * 5]
    want = [plain.generate(p, 30).output_token_ids for p in prompts]
    runner = Scheduler(spec, max_batch_size=2)
    handles = [runner.add(spec.request(p, 30)) for p in prompts]
    while runner.has_work():
        runner.step()
    assert [h.result.output_token_ids for h in handles] == want
    assert runner.speculation.drafting.verifies > 0


def test_no_ragged_step_where_the_attention_takes_no_mask(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    spec = KVBoost(model, tokenizer, chunk_size=16, attention_backend="model", speculative="prompt_lookup")
    runner = Scheduler(spec, max_batch_size=2)
    runner.forwards.ragged_mask = None  # what flash attention gets: rows decode plainly beside each other
    handles = [runner.add(spec.request("river stone lantern quiet orbit " * 6, 20)) for _ in range(2)]
    while runner.has_work():
        runner.step()
    assert runner.speculation.drafting.verifies == 0 and all(h.result.generated_tokens == 20 for h in handles)
