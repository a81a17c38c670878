"""kvboost serve --content-reuse: documents warmed alone are reused when a request has them in another order,
on the continuous-batching worker (the default) and on the one-at-a-time worker; the openai SDK sees it in
usage.prompt_tokens_details.cached_tokens."""
from __future__ import annotations

import pytest

from kvboost import KVBoost

from ..reuse._rag import CHUNK, documents, rag_prompt
from .conftest import TINY_NAME, live_server


@pytest.fixture(scope="module")
def rag_engine(tiny_model_dir, device):
    engine = KVBoost.from_pretrained(str(tiny_model_dir), chunk_size=CHUNK, content_reuse=True, device=str(device))
    for doc in documents():
        engine.warm(doc)
    return engine


@pytest.mark.parametrize("max_batch_size", [16, 1], ids=["batched", "single"])
def test_warmed_documents_in_another_order_are_reused(rag_engine, tiny_model_dir, max_batch_size):
    prompt = rag_prompt(documents(), [2, 0, 1])
    messages = [{"role": "user", "content": prompt}]
    expected = rag_engine.generate(messages=messages, max_new_tokens=4)
    assert expected.approximate_tokens > 0
    with live_server(rag_engine, model=str(tiny_model_dir), max_batch_size=max_batch_size) as live:
        assert live.scheduler.batched == (max_batch_size > 1)
        r = live.client().chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=4, temperature=0)
        # Far more than any exact prefix of this prompt (the chat template's first tokens) could give.
        assert r.usage.prompt_tokens_details.cached_tokens == expected.cached_tokens > 3 * CHUNK
        assert r.choices[0].message.content == expected.output_text
        fresh_tenant = {"cache_salt": f"tenant-{max_batch_size}"}
        plain = live.client().chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=4,
                                                      temperature=0, extra_body=fresh_tenant)
        assert plain.usage.prompt_tokens_details.cached_tokens < CHUNK  # a new tenant sees none of it


@pytest.mark.parametrize("max_batch_size,order", [(16, [1, 2, 0]), (1, [0, 2, 1])], ids=["batched", "single"])
def test_content_reuse_can_be_turned_off_per_request(rag_engine, tiny_model_dir, max_batch_size, order):
    messages = [{"role": "user", "content": rag_prompt(documents(), order)}]  # a first document no other test put first
    with live_server(rag_engine, model=str(tiny_model_dir), max_batch_size=max_batch_size) as live:
        r = live.client().chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=4, temperature=0,
                                                  extra_body={"content_reuse": False})
    # the exact prefix only (template and intro), none of the documents away from their positions (> 3 chunks)
    assert r.usage.prompt_tokens_details.cached_tokens < 3 * CHUNK
    exact = rag_engine.generate(messages=messages, max_new_tokens=4, content_reuse=False, mode="baseline")
    assert r.choices[0].message.content == exact.output_text
