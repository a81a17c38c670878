"""Prometheus metrics on a registry of the app's own (several apps can live in one process, e.g. tests)."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..results import GenerationResult

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_depth: Callable[[], float], active: Callable[[], float],
                 reuse_ratio: Callable[[], float], acceptance: Callable[[], float] = lambda: 0.0,
                 batched_proposals: Callable[[], float] = lambda: 0.0):
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

    def observe_result(self, endpoint: str, result: GenerationResult) -> None:
        self.prompt_tokens.inc(result.prompt_tokens)
        self.completion_tokens.inc(result.generated_tokens)
        self.cached_tokens.inc(result.cached_tokens)
        self.draft_tokens.inc(result.draft_tokens)
        self.accepted_tokens.inc(result.accepted_tokens)
        self.outcomes.labels(endpoint, "ok").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _safe(fn: Callable[[], float]) -> Callable[[], float]:
    def wrapped() -> float:
        try:
            return float(fn())
        except Exception:  # a scrape must never fail because a statistic could not be read
            return float("nan")

    return wrapped
