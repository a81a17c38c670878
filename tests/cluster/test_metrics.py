"""cluster/metrics.py: the replicas' /metrics merged into one exposition that Prometheus parses back, every sample
labelled with its replica, each family's samples under one HELP / TYPE."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvboost.cluster.metrics import merge_expositions


def _exposition(requests: int, running: float, ttft: list[float]) -> str:
    registry = CollectorRegistry()
    Counter("kvboost_requests", "HTTP requests", ["route"], registry=registry).labels("/v1/chat").inc(requests)
    Gauge("vllm:num_requests_running", "running", registry=registry).set(running)
    h = Histogram("vllm:time_to_first_token_seconds", "TTFT", registry=registry, buckets=(0.1, 1.0))
    for v in ttft:
        h.observe(v)
    return generate_latest(registry).decode()


def test_every_replicas_samples_arrive_labelled_and_grouped():
    text = merge_expositions({"a": _exposition(3, 1, [0.05]), "b": _exposition(5, 0, [0.5, 2.0])}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    requests = {s.labels["replica"]: s.value for s in families["kvboost_requests"].samples
                if s.name == "kvboost_requests_total"}
    assert requests == {"a": 3.0, "b": 5.0}
    assert {s.labels["replica"]: s.value for s in families["vllm:num_requests_running"].samples} == {"a": 1.0,
                                                                                                     "b": 0.0}
    counts = {s.labels["replica"]: s.value for s in families["vllm:time_to_first_token_seconds"].samples
              if s.name.endswith("_count")}
    assert counts == {"a": 1.0, "b": 2.0}
    assert text.count("# TYPE vllm:time_to_first_token_seconds histogram") == 1
    assert merge_expositions({}) == b""
