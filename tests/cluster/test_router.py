"""cluster/router.py, Ray Serve's side of the routing: the replica holding the request's chunks is the first rank
and the rest follow by load; a replica whose routing report could not be read is routed by load alone; a pinned
replica (the one that stored a Responses turn) goes first while it lives; load past the imbalance wins."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID  # noqa: E402

from kvboost.chunking import Chunker  # noqa: E402
from kvboost.cluster.asgi import HttpRequest  # noqa: E402
from kvboost.cluster.router import KVBoostRouter, RoundRobinRouter, RoutedRequest  # noqa: E402
from kvboost.cluster.routing import RequestKeys  # noqa: E402

DEPLOYMENT = DeploymentID(name="kvboost-replica", app_name="kvboost")
KEYS = RequestKeys.of(Chunker(16, "ns"), list(range(100, 164)))
HTTP = HttpRequest("POST", "/v1/chat/completions")


def _replica(name: str, stats: dict) -> SimpleNamespace:
    return SimpleNamespace(replica_id=ReplicaID(unique_id=name, deployment_id=DEPLOYMENT), routing_stats=stats,
                           max_ongoing_requests=32)


def _holding(name: str, queued: int = 0) -> SimpleNamespace:
    return _replica(name, {"queued": queued, "chains": list(KEYS.chains), "contents": list(KEYS.contents)})


def _cold(name: str, queued: int = 0) -> SimpleNamespace:
    return _replica(name, {"queued": queued, "chains": [], "contents": []})


def _ranks(replicas, request=None, imbalance: int = 4, queue_lens: dict | None = None) -> list[list[str]]:
    async def run():
        router = KVBoostRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(imbalance=imbalance)
        for name, n in (queue_lens or {}).items():
            router.replica_queue_len_cache.update(ReplicaID(unique_id=name, deployment_id=DEPLOYMENT), n)
        pending = None if request is None else SimpleNamespace(args=[request], kwargs={})
        ranks = await router.choose_replicas(replicas, pending)
        return [[r.replica_id.unique_id for r in rank] for rank in ranks]

    return asyncio.run(run())


def test_the_replica_holding_the_chunks_comes_first_then_the_rest_by_load():
    replicas = [_cold("b", queued=2), _cold("c", queued=0), _holding("a", queued=1)]
    assert _ranks(replicas, RoutedRequest(HTTP, KEYS)) == [["a"], ["c", "b"]]


def test_a_replica_without_a_readable_report_is_routed_by_load():
    # "a" holds the chunks, but its report never arrived: it cannot win on them; the least-loaded replica does.
    # Its queue is known from Ray's queue-length cache, as it is for every replica a request was sent to.
    replicas = [_replica("a", {}), _cold("b", queued=3), _cold("c", queued=0)]
    assert _ranks(replicas, RoutedRequest(HTTP, KEYS), queue_lens={"a": 1})[0] == ["c"]
    replicas = [_replica("a", {}), _holding("b", queued=3)]
    assert _ranks(replicas, RoutedRequest(HTTP, KEYS), queue_lens={"a": 0})[0] == ["b"]


def test_load_past_the_imbalance_wins_and_the_queue_cache_is_fresher_than_reports():
    replicas = [_holding("a", queued=0), _cold("b", queued=0)]
    assert _ranks(replicas, RoutedRequest(HTTP, KEYS), imbalance=4, queue_lens={"a": 5, "b": 0})[0] == ["b"]
    assert _ranks(replicas, RoutedRequest(HTTP, KEYS), imbalance=4, queue_lens={"a": 3, "b": 0})[0] == ["a"]


def test_a_pinned_replica_goes_first_while_it_lives():
    replicas = [_holding("a"), _cold("b")]
    assert _ranks(replicas, RoutedRequest(HTTP, KEYS, pin="b")) == [["b"], ["a"]]
    assert _ranks(replicas, RoutedRequest(HTTP, KEYS, pin="gone"))[0] == ["a"]


def test_calls_that_are_not_requests_go_by_load():
    assert _ranks([_cold("a", queued=2), _cold("b", queued=1)]) == [["b", "a"]]
    assert _ranks([]) == []


def test_the_round_robin_baseline_takes_replicas_in_turn_whatever_they_hold():
    async def run():
        router = RoundRobinRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        replicas = [_cold("c"), _holding("a", queued=5), _cold("b")]
        pending = SimpleNamespace(args=[RoutedRequest(HTTP, KEYS)], kwargs={})
        return [[[r.replica_id.unique_id for r in rank] for rank in await router.choose_replicas(replicas, pending)]
                for _ in range(4)]

    assert asyncio.run(run()) == [[["a"], ["b", "c"]], [["b"], ["a", "c"]], [["c"], ["a", "b"]], [["a"], ["b", "c"]]]
