"""The server with contexts longer than device_kv_max_tokens: they run from host memory with the reply of a resident
engine, by a one-at-a-time server and by a batching one, where they are rows of the loop beside short requests."""
from __future__ import annotations

from kvboost import KVBoost

from ..prompts import text_with_tokens
from ..tiny_models import make_tiny_model
from .conftest import live_server


def test_long_contexts_run_from_host_memory_alone_and_beside_short_requests(tokenizer, tiny_model_dir):
    model = make_tiny_model("llama", tokenizer)
    resident = KVBoost(model, tokenizer, chunk_size=16)
    streaming = KVBoost(model, tokenizer, chunk_size=16, device_kv_max_tokens=40)
    prompt = text_with_tokens(tokenizer, 80, seed=3)
    want = resident.generate(prompt, 8, mode="baseline").output_text
    with live_server(streaming, model=str(tiny_model_dir), max_batch_size=1) as live:
        got = live.client().completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0)
    assert got.choices[0].text == want
    assert streaming.cache_stats()["streamed"]["sequences"] == 1

    # A batching server: long and short requests at once, from several clients.
    prompts = [prompt, "river stone", text_with_tokens(tokenizer, 70, seed=4), "quiet orbit lantern", "stone"]
    wants = [resident.generate(p, 6, mode="baseline").output_text for p in prompts]
    with live_server(streaming, model=str(tiny_model_dir), max_batch_size=4, batch_window_ms=50) as live:
        got = live.complete_at_once(prompts, [6] * len(prompts))
        live.wait_idle()
        snapshot = live.scheduler.snapshot()
    assert got == wants
    assert snapshot["completed"] == 5 and snapshot["batch_steps"] > 0 and snapshot["max_rows_in_a_step"] >= 2
    assert streaming.cache_stats()["streamed"]["sequences"] == 3
    assert not streaming.scheduler.has_work()  # nothing left in the loop
