"""The server with contexts longer than device_kv_max_tokens: a one-at-a-time server streams them from host memory
with the reply of a resident engine; a batching server refuses them with a 400 naming the limit."""
from __future__ import annotations

import openai
import pytest

from kvboost import KVBoost

from ..prompts import text_with_tokens
from ..tiny_models import make_tiny_model
from .conftest import live_server


def test_long_contexts_stream_one_at_a_time_and_batching_refuses_them(tokenizer, tiny_model_dir):
    model = make_tiny_model("llama", tokenizer)
    resident = KVBoost(model, tokenizer, chunk_size=16)
    streaming = KVBoost(model, tokenizer, chunk_size=16, paged_kv=True, device_kv_budget_bytes=1 << 20,
                        device_kv_max_tokens=40)
    prompt = text_with_tokens(tokenizer, 80, seed=3)
    want = resident.generate(prompt, 8, mode="baseline").output_text
    with live_server(streaming, model=str(tiny_model_dir), max_batch_size=1) as live:
        got = live.client().completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0)
    assert got.choices[0].text == want
    assert streaming.cache_stats()["paged_kv"]["streamed"]["requests"] == 1
    with live_server(streaming, model=str(tiny_model_dir), max_batch_size=4) as live:
        with pytest.raises(openai.BadRequestError, match="device_kv_max_tokens") as info:
            live.client().completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0)
        assert info.value.param == "max_tokens"
        short = live.client().completions.create(model="tiny-llama", prompt="river stone", max_tokens=4,
                                                 temperature=0)
    assert short.choices[0].text == resident.generate("river stone", 4, mode="baseline").output_text
