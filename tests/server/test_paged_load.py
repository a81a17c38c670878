"""Concurrent clients against a batching server whose paged engine holds three chunks on the device: every reply
equals plain generation (requests batched, speculative ones run apart, chunks offloaded to the host and restored
meanwhile), and once idle no block is held by a finished request."""
from __future__ import annotations

import threading

import pytest

from kvboost import KVBoost

from ..kv.test_paged_traces import Trace, check_holds, make_engine
from ..tiny_models import make_tiny_model
from .conftest import TINY_NAME, live_server

CLIENTS = 4


@pytest.mark.parametrize("setup", ["workspace", "table"])
def test_concurrent_requests_under_memory_pressure(tokenizer, tmp_path, setup):
    model = make_tiny_model("llama", tokenizer)
    engine = make_engine(model, tokenizer, setup, tmp_path)
    trace = Trace(tokenizer, KVBoost(model, tokenizer, chunk_size=16), seed=5)
    jobs = []
    for _ in range(16):
        prompt, options = trace.prompt(), trace.options()
        jobs.append((prompt, options, trace.want(prompt, options)[1]))
        trace.turns.append(prompt + " and")
    got: list[str | None] = [None] * len(jobs)
    with live_server(engine, max_batch_size=4, batch_window_ms=5) as live:
        def client(k: int) -> None:
            http = live.client()
            for i in range(k, len(jobs), CLIENTS):
                prompt, options, _ = jobs[i]
                extra = {key: options[key] for key in ("speculative", "mode", "repetition_penalty") if key in options}
                if "regex" in options:
                    extra["guided_regex"] = options["regex"]  # vLLM's name for it
                got[i] = http.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=options["max_new_tokens"],
                                                 temperature=0, stop=options.get("stop"),
                                                 logprobs=options.get("logprobs"),
                                                 extra_body=extra or None).choices[0].text

        threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        live.wait_idle()
    assert got == [want for _, _, want in jobs]
    check_holds(engine, "after the load")
    stats = engine.cache_stats()["paged_kv"]
    assert stats["host"]["offloaded"] > 0 and stats["host"]["restored"] > 0
