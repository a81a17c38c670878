"""Real model (embedded SmolLM2-135M): documents warmed alone, reused in a shuffled multi-document prompt."""
from __future__ import annotations

import pytest
import torch

from benchmarks.rag import SYSTEM_PROMPT, build_messages, doc_text
from benchmarks.workloads import load_rag
from kvboost import KVBoost

pytestmark = pytest.mark.slow


def test_rag_prompt_reuses_documents_at_new_positions(smol):
    model, tokenizer = smol
    engine = KVBoost(model, tokenizer, content_reuse=True)
    docs, items = load_rag()
    item = next(it for it in items if len(it["doc_ids"]) == 4)
    for doc_id in item["doc_ids"]:
        engine.warm(doc_text(docs[doc_id]))
    engine.warm(messages=[{"role": "system", "content": SYSTEM_PROMPT}])
    messages = build_messages(docs, item)
    ids = engine.encode(messages=messages)
    base = engine.generate(messages=messages, max_new_tokens=1, mode="baseline", return_logits=True)
    with torch.inference_mode():
        full = model(torch.tensor([ids], device=model.device)).logits[0, -1].float()
    assert (base.first_token_logits - full).abs().max().item() < 1e-3

    def run(strategy: str, ratio: float):
        engine.config.recompute_strategy, engine.config.recompute_ratio = strategy, ratio
        engine.forget_workspace()
        return engine.generate(messages=messages, max_new_tokens=1, return_logits=True)

    blend = run("cacheblend", 0.15)
    doc_tokens = sum(len(engine.encode(doc_text(docs[d]))) for d in item["doc_ids"])
    assert blend.exact_tokens > 0  # the warmed system prompt
    assert blend.approximate_tokens >= doc_tokens - 4  # every document, at its new position
    assert blend.recomputed_tokens == pytest.approx(0.15 * blend.approximate_tokens, abs=1)
    assert int(blend.first_token_logits.argmax()) == int(full.argmax())
    assert blend.ttft_ms < base.ttft_ms  # cost grows with r, not with the prompt (loose: shared machines)

    exact = run("cacheblend", 1.0)
    assert (exact.first_token_logits - full).abs().max().item() < 1e-3
    none = run("none", 0.0)
    kl = lambda x: torch.nn.functional.kl_div(torch.log_softmax(x, -1), torch.log_softmax(full, -1),  # noqa: E731
                                              log_target=True, reduction="sum").item()
    assert kl(blend.first_token_logits) < kl(none.first_token_logits)
