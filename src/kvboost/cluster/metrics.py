"""The cluster's /metrics: every replica's Prometheus text merged into one exposition, each sample labelled with the
replica it came from (a scraper of the ingress sees every replica, not whichever one answered)."""
from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

REPLICA_LABEL = "replica"


def merge_expositions(texts: dict[str, str]) -> bytes:
    """{replica: its /metrics text} -> one exposition; a family's samples stay together under one HELP / TYPE."""
    merged: dict[str, Metric] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            into.samples += [s._replace(labels={**s.labels, REPLICA_LABEL: replica}) for s in family.samples]
    return generate_latest(SimpleNamespace(collect=merged.values))  # any object with collect() is a collector to it
