"""Prometheus metrics on a registry of the app's own (several apps can live in one process, e.g. tests): KVBoost's own,
and the quantities KVBoost has under vLLM's names (`vllm:...`, label model_name), which KV-aware routers and
dashboards built for vLLM read (llm-d's scorers, vllm-router, Dynamo).

vLLM's names for what KVBoost measures: KV cache usage is the device tier's stored bytes over its budget; prefix cache
queries / hits are prompt tokens looked up / reused; inter-token latency is each token after a request's first,
observed at that request's mean gap."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..results import GenerationResult

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_depth: Callable[[], float], active: Callable[[], float],
                 cache_stats: Callable[[], dict], model_name: str = ""):
        r = self.registry = CollectorRegistry()
        self.model_name = model_name

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            if name.startswith("vllm:"):
                Gauge(name, doc, ["model_name"], registry=r).labels(model_name).set_function(_safe(fn))
            else:
                Gauge(name, doc, registry=r).set_function(_safe(fn))

        def speculative(key: str) -> Callable[[], float]:
            return lambda: cache_stats().get("speculative", {}).get(key, 0)

        def vllm_counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=r).labels(model_name)

        def vllm_histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)

        self.requests = Counter("kvboost_requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=r)
        self.outcomes = Counter("kvboost_generations", "Generations by endpoint and outcome "
                                "(ok, error, cancelled)", ["endpoint", "outcome"], registry=r)
        self.ttft = Histogram("kvboost_ttft_seconds", "Time from request arrival to the first output text",
                              ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("kvboost_request_latency_seconds", "Time from request arrival to the last token",
                                 ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvboost_prompt_tokens", "Prompt tokens processed", registry=r)
        self.completion_tokens = Counter("kvboost_completion_tokens", "Tokens generated", registry=r)
        self.cached_tokens = Counter("kvboost_cached_prompt_tokens", "Prompt tokens whose K/V was reused", registry=r)
        gauge("kvboost_queue_depth", "Requests waiting for the worker", queue_depth)
        gauge("kvboost_active_requests", "Requests being generated now", active)
        gauge("kvboost_cache_reuse_ratio", "Cached / prompt tokens since start (engine.cache_stats)",
              lambda: cache_stats().get("reuse_ratio", 0.0))
        self.draft_tokens = Counter("kvboost_speculative_draft_tokens", "Draft tokens proposed and verified",
                                    registry=r)
        self.accepted_tokens = Counter("kvboost_speculative_accepted_tokens", "Draft tokens the model kept", registry=r)
        gauge("kvboost_speculative_acceptance_rate", "Accepted / drafted tokens since start (engine.cache_stats)",
              speculative("acceptance_rate"))
        gauge("kvboost_speculative_batched_proposals", "Draft proposals verified beside other rows of a batch, since "
              "start (engine.cache_stats)", speculative("batched_proposals"))

        gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", queue_depth)
        gauge("vllm:num_requests_running", "Requests being generated", active)
        gauge("vllm:kv_cache_usage_perc", "Stored K/V in the device tier over its budget (0-1)",
              lambda: _device_tier_usage(cache_stats()))
        self.vllm_prompt = vllm_counter("vllm:prompt_tokens", "Prompt tokens processed")
        self.vllm_generation = vllm_counter("vllm:generation_tokens", "Tokens generated")
        self.vllm_queries = vllm_counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.vllm_hits = vllm_counter("vllm:prefix_cache_hits", "Prompt tokens whose K/V was reused")
        self.vllm_success = Counter("vllm:request_success", "Finished requests by finish reason",
                                    ["model_name", "finished_reason"], registry=r)
        self.vllm_ttft = vllm_histogram("vllm:time_to_first_token_seconds", "Time to the first token")
        self.vllm_e2e = vllm_histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token")
        self.vllm_itl = vllm_histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens")

    def observe_ttft(self, endpoint: str, seconds: float) -> None:
        self.ttft.labels(endpoint).observe(seconds)
        self.vllm_ttft.observe(seconds)

    def observe_latency(self, endpoint: str, seconds: float) -> None:
        self.latency.labels(endpoint).observe(seconds)
        self.vllm_e2e.observe(seconds)

    def observe_result(self, endpoint: str, result: GenerationResult) -> None:
        self.vllm_prompt.inc(result.prompt_tokens)
        self.vllm_generation.inc(result.generated_tokens)
        self.vllm_queries.inc(result.prompt_tokens)
        self.vllm_hits.inc(result.cached_tokens)
        self.vllm_success.labels(self.model_name, result.finish_reason).inc()
        if result.generated_tokens > 1:
            gap = max(result.total_ms - result.ttft_ms, 0.0) / 1e3 / (result.generated_tokens - 1)
            for _ in range(result.generated_tokens - 1):
                self.vllm_itl.observe(gap)
        self.prompt_tokens.inc(result.prompt_tokens)
        self.completion_tokens.inc(result.generated_tokens)
        self.cached_tokens.inc(result.cached_tokens)
        self.draft_tokens.inc(result.draft_tokens)
        self.accepted_tokens.inc(result.accepted_tokens)
        self.outcomes.labels(endpoint, "ok").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _device_tier_usage(stats: dict) -> float:
    tier = stats.get("tiers", {}).get("memory", {})
    return tier.get("bytes", 0) / tier["budget_bytes"] if tier.get("budget_bytes") else 0.0


def _safe(fn: Callable[[], float]) -> Callable[[], float]:
    def wrapped() -> float:
        try:
            return float(fn())
        except Exception:  # a scrape must never fail because a statistic could not be read
            return float("nan")

    return wrapped
