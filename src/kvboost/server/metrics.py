"""Prometheus metrics on a registry of the app's own (several apps can live in one process, e.g. tests): KVBoost's own,
and the quantities KVBoost has under vLLM's names (`vllm:...`, label model_name), which KV-aware routers and
dashboards built for vLLM read (llm-d's scorers, vllm-router, Dynamo)."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..results import GenerationResult

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_depth: Callable[[], float], active: Callable[[], float],
                 reuse_ratio: Callable[[], float], acceptance: Callable[[], float] = lambda: 0.0,
                 batched_proposals: Callable[[], float] = lambda: 0.0, model_name: str = "",
                 kv_usage: Callable[[], float] = lambda: 0.0):
        r = self.registry = CollectorRegistry()
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
        self.cached_tokens = Counter("kvboost_cached_prompt_tokens", "Prompt tokens whose K/V was reused",
                                     registry=r)
        Gauge("kvboost_queue_depth", "Requests waiting for the worker", registry=r).set_function(
            _safe(queue_depth))
        Gauge("kvboost_active_requests", "Requests being generated now", registry=r).set_function(_safe(active))
        Gauge("kvboost_cache_reuse_ratio", "Cached / prompt tokens since start (engine.cache_stats)",
              registry=r).set_function(_safe(reuse_ratio))
        self.draft_tokens = Counter("kvboost_speculative_draft_tokens", "Draft tokens proposed and verified",
                                    registry=r)
        self.accepted_tokens = Counter("kvboost_speculative_accepted_tokens", "Draft tokens the model kept",
                                       registry=r)
        Gauge("kvboost_speculative_acceptance_rate", "Accepted / drafted tokens since start (engine.cache_stats)",
              registry=r).set_function(_safe(acceptance))
        Gauge("kvboost_speculative_batched_proposals", "Draft proposals verified beside other rows of a batch, since "
              "start (engine.cache_stats)", registry=r).set_function(_safe(batched_proposals))

        self.vllm = _VllmNames(r, model_name, queue_depth, active, kv_usage)

    def observe_ttft(self, endpoint: str, seconds: float) -> None:
        self.ttft.labels(endpoint).observe(seconds)
        self.vllm.ttft.observe(seconds)

    def observe_latency(self, endpoint: str, seconds: float) -> None:
        self.latency.labels(endpoint).observe(seconds)
        self.vllm.e2e.observe(seconds)

    def observe_result(self, endpoint: str, result: GenerationResult) -> None:
        self.vllm.observe(result)
        self.prompt_tokens.inc(result.prompt_tokens)
        self.completion_tokens.inc(result.generated_tokens)
        self.cached_tokens.inc(result.cached_tokens)
        self.draft_tokens.inc(result.draft_tokens)
        self.accepted_tokens.inc(result.accepted_tokens)
        self.outcomes.labels(endpoint, "ok").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _VllmNames:
    """vLLM's metric names for what KVBoost measures. KV cache usage: the device tier's stored bytes over its budget;
    prefix cache queries / hits: prompt tokens looked up / reused; inter-token latency: each token after a request's
    first, observed at that request's mean gap."""

    def __init__(self, r: CollectorRegistry, model: str, waiting: Callable[[], float], running: Callable[[], float],
                 kv_usage: Callable[[], float]):
        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            Gauge(name, doc, ["model_name"], registry=r).labels(model).set_function(_safe(fn))

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=r).labels(model)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(model)

        gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", waiting)
        gauge("vllm:num_requests_running", "Requests being generated", running)
        gauge("vllm:kv_cache_usage_perc", "Stored K/V in the device tier over its budget (0-1)", kv_usage)
        self.prompt = counter("vllm:prompt_tokens", "Prompt tokens processed")
        self.generation = counter("vllm:generation_tokens", "Tokens generated")
        self.queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.hits = counter("vllm:prefix_cache_hits", "Prompt tokens whose K/V was reused")
        self.success = Counter("vllm:request_success", "Finished requests by finish reason",
                               ["model_name", "finished_reason"], registry=r)
        self.model = model
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to the first token")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens")

    def observe(self, result: GenerationResult) -> None:
        self.prompt.inc(result.prompt_tokens)
        self.generation.inc(result.generated_tokens)
        self.queries.inc(result.prompt_tokens)
        self.hits.inc(result.cached_tokens)
        self.success.labels(self.model, result.finish_reason).inc()
        if result.generated_tokens > 1:
            gap = max(result.total_ms - result.ttft_ms, 0.0) / 1e3 / (result.generated_tokens - 1)
            for _ in range(result.generated_tokens - 1):
                self.itl.observe(gap)


def _safe(fn: Callable[[], float]) -> Callable[[], float]:
    def wrapped() -> float:
        try:
            return float(fn())
        except Exception:  # a scrape must never fail because a statistic could not be read
            return float("nan")

    return wrapped
