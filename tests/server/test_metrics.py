"""server/metrics.py and /tokenize: after requests, /metrics holds vLLM's names for the quantities KVBoost has (label
model_name), with values that follow the requests: tokens, prefix-cache queries and hits, finished requests, latency
histograms, queue and KV usage gauges. /tokenize (vLLM's, which routers call) gives the ids a request is prefilled
with."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from .conftest import TINY_NAME

PROMPT = "A prompt long enough to store a chunk or two of K/V, " * 6


def _samples(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model_name") == TINY_NAME and "le" not in sample.labels:
                key = sample.name + "".join(f"|{v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
                out[key] = sample.value
    return out


def test_vllm_metric_names_follow_the_requests(server, client):
    with server.http() as http:
        before = _samples(http.get("/metrics").text)
        first = client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=4, temperature=0)
        again = client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=4, temperature=0)
        after = _samples(http.get("/metrics").text)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    prompt = first.usage.prompt_tokens + again.usage.prompt_tokens
    assert grew("vllm:prompt_tokens_total") == grew("vllm:prefix_cache_queries_total") == prompt
    assert grew("vllm:prefix_cache_hits_total") == again.usage.prompt_tokens_details.cached_tokens > 0
    assert grew("vllm:generation_tokens_total") == 8
    assert grew("vllm:request_success_total|length") == 2
    assert grew("vllm:time_to_first_token_seconds_count") == 2 == grew("vllm:e2e_request_latency_seconds_count")
    assert grew("vllm:inter_token_latency_seconds_count") == 6  # tokens after each request's first
    assert after["vllm:num_requests_waiting"] == 0 and after["vllm:num_requests_running"] == 0
    assert 0 < after["vllm:kv_cache_usage_perc"] <= 1


def test_tokenize_gives_the_ids_the_chat_endpoint_prefills(server, client):
    messages = [{"role": "user", "content": "Count the tokens of this question."}]
    with server.http() as http:
        got = http.post("/tokenize", json={"model": TINY_NAME, "messages": messages}).json()
        text = http.post("/tokenize", json={"prompt": PROMPT}).json()
        both = http.post("/tokenize", json={"prompt": PROMPT, "messages": messages})
    chat = client.chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=1)
    assert got["count"] == len(got["tokens"]) == chat.usage.prompt_tokens
    assert text["count"] == client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=1).usage.prompt_tokens
    assert both.status_code == 400
