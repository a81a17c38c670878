"""Few-row Linear products as W @ x^T where measured faster: the same values up to summation order, a choice
measured per bucket of row counts, and the model's modules left as they were after every forward."""
from __future__ import annotations

import pytest
import torch

from kvboost import KVBoost
from kvboost.model.few_rows import TRIALS, FewRowLinears, _Bucket, few_row_linears

from ..prompts import text_with_tokens
from ..tiny_models import make_tiny_model


def _logits(model, ids, linears: FewRowLinears | None, rows: int):
    with torch.inference_mode():
        if linears is None:
            return model(input_ids=ids).logits
        with linears.forward(rows):
            return model(input_ids=ids).logits


def test_both_forms_give_the_same_products_and_leave_no_trace(tokenizer):
    model = make_tiny_model("llama", tokenizer, device="cpu")
    linears = FewRowLinears(model)
    assert linears.linears  # q/k/v/o, MLP and lm_head projections
    ids = torch.randint(5, 200, (1, 4))
    plain = _logits(model, ids, None, 4)
    seen = []
    for _ in range(2 * TRIALS):  # the bucket's measuring forwards: plain, transposed, plain, transposed
        seen.append(linears.buckets[(3, 4)].next_form())
        assert torch.allclose(_logits(model, ids, linears, 4), plain, atol=1e-5)
    assert seen == [False, True] * TRIALS
    assert all("forward" not in vars(m) for m in model.modules())  # swapped for one forward only
    assert linears.stats()["3-4"]["form"] in ("W @ x^T", "x @ W^T")


def test_the_faster_form_is_kept_per_bucket():
    bucket = _Bucket()
    for seconds in (1.0, 0.5, 0.9, 0.6):  # plain, transposed, plain, transposed
        bucket.timed(bucket.next_form(), seconds)
    assert bucket.choice is True and bucket.next_form() is True
    slow = _Bucket()
    for seconds in (0.5, 1.0, 0.4, 0.9):
        slow.timed(slow.next_form(), seconds)
    assert slow.choice is False
    slow.timed(True, 0.01)  # decided: later forwards are not timed
    assert slow.choice is False


def test_single_rows_long_suffixes_and_hooked_models_are_left_alone(tokenizer):
    assert FewRowLinears.bucket_of(1) is None and FewRowLinears.bucket_of(17) is None
    assert FewRowLinears.bucket_of(2) == (2, 2) and FewRowLinears.bucket_of(16) == (9, 16)
    model = make_tiny_model("llama", tokenizer, device="cpu")
    assert few_row_linears(model) is few_row_linears(model) is not None  # one per model
    hooked = make_tiny_model("llama", tokenizer, device="cpu", seed=3)
    hooked.lm_head.forward = hooked.lm_head.forward  # as accelerate's hooks do: an instance-level forward
    assert few_row_linears(hooked) is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_outputs_are_unchanged(tokenizer, arch):
    """Speculative verifies and batched decode steps run few-row forwards: greedy tokens equal plain decoding."""
    model = make_tiny_model(arch, tokenizer, device="cpu")
    engine = KVBoost(model, tokenizer, chunk_size=16)
    prompts = [text_with_tokens(tokenizer, 40, seed=s) for s in range(3)]
    plain = [engine.generate(p, 24, speculative="off").output_token_ids for p in prompts]
    spec = [engine.generate(p, 24, speculative="prompt_lookup").output_token_ids for p in prompts]
    batched = [r.output_token_ids for r in engine.generate_batch(prompts, 24)]
    assert spec == plain and batched == plain
    stats = engine.cache_stats()["fast_path"]["few_row_linears"]
    assert stats == few_row_linears(model).stats()
    assert any(b["plain_ms"] is not None for b in stats.values())  # few-row forwards ran through it
