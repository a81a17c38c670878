"""Bounded load: 32 concurrent openai clients x 4 requests sharing a ~1k-token system prompt (embedded model)."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from kvboost import KVBoost
from kvboost.samples import load_system_prompt

from .conftest import live_server

CLIENTS = 32
REQUESTS_EACH = 4
MAX_TOKENS = 4


@pytest.mark.slow
def test_32_clients_x_4_requests_share_a_system_prompt_with_no_5xx(smol):
    model, tokenizer = smol
    engine = KVBoost(model, tokenizer)
    system, questions = load_system_prompt()
    assert len(tokenizer(system)["input_ids"]) >= 1000
    with live_server(engine, served_model_name=None) as srv:
        outcomes = asyncio.run(_load(srv.url, system, questions))
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            health = http.get("/health")
            stats = http.get("/v1/stats").json()
            metrics = http.get("/metrics").text
    failures = [o for o in outcomes if not isinstance(o, int)]
    assert not failures, failures[:5]
    assert len(outcomes) == CLIENTS * REQUESTS_EACH
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert 'status="5' not in metrics
    # Nearly every request reused the system prompt's K/V (the first ones compute it once).
    assert sum(o >= 1000 for o in outcomes) >= len(outcomes) * 0.9
    assert stats["cache"]["reuse_ratio"] > 0.8


async def _load(url: str, system: str, questions: list[str]) -> list[object]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    deadline = time.monotonic() + 240

    async def one_client(c: int) -> list[object]:
        out: list[object] = []
        for r in range(REQUESTS_EACH):
            if time.monotonic() > deadline:
                out.append("skipped: load test deadline")
                continue
            question = questions[(c * REQUESTS_EACH + r) % len(questions)]
            try:
                resp = await client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", max_tokens=MAX_TOKENS, temperature=0, stream=(r % 2 == 1),
                    messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
                    **({"stream_options": {"include_usage": True}} if r % 2 else {}))
                if r % 2:
                    usage = None
                    async for chunk in resp:
                        usage = chunk.usage or usage
                    out.append(usage.prompt_tokens_details.cached_tokens)
                else:
                    assert resp.choices[0].message.content is not None
                    out.append(resp.usage.prompt_tokens_details.cached_tokens)
            except Exception as exc:  # recorded, not raised: the test reports every failure kind
                out.append(f"{type(exc).__name__}: {exc}")
        return out

    try:
        per_client = await asyncio.gather(*(one_client(c) for c in range(CLIENTS)))
    finally:
        await client.close()
    return [o for outs in per_client for o in outs]
