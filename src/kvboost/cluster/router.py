"""Ray Serve's side of KV-aware routing: a RequestRouter that ranks replicas by cluster/routing.py's policy, from the
routing stats each replica reports (Replica.record_routing_stats: its held chunk keys and queue)."""
from __future__ import annotations

from dataclasses import dataclass

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .asgi import HttpRequest
from .routing import RecentRoutes, ReplicaView, RequestKeys, RoutingPolicy, choose


@dataclass(frozen=True)
class RoutedRequest:
    """What the ingress hands a replica: the HTTP request, its chunk keys (None: none could be read) and, for a
    Responses turn that continues a stored response, the replica that stored it."""

    http: HttpRequest
    keys: RequestKeys | None = None
    pin: str | None = None  # a replica's unique id


class KVBoostRouter(RequestRouter):
    """First rank: the replica choose() picks (longest run of held chunks, unless load is imbalanced; a pinned replica
    while it lives); then the others, least loaded first, for when the first is full."""

    def initialize_state(self, imbalance: int = 4, recent_ttl_s: float = 10.0, **kwargs) -> None:
        self.policy = RoutingPolicy(imbalance=imbalance)
        self.recent = RecentRoutes(recent_ttl_s)  # keys sent lately, until the replicas' reports show them

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = _routed(pending_request)
        views = {r.replica_id.unique_id: self._view(r) for r in candidate_replicas}
        by_load = sorted(candidate_replicas, key=lambda r: views[r.replica_id.unique_id].queued)
        if request is None:  # a call that is not an HTTP request (e.g. the ingress asking for the recipe)
            return [by_load]
        first = [r for r in candidate_replicas if r.replica_id.unique_id == request.pin]
        if not first:  # no pin, or its replica is gone
            keys = request.keys or RequestKeys((), ())
            route = choose(keys, [self.recent.view(v) for v in views.values()], self.policy)
            self.recent.add(route.replica, keys)
            first = [r for r in candidate_replicas if r.replica_id.unique_id == route.replica]
        return [first, [r for r in by_load if r not in first]]

    def _view(self, replica: RunningReplica) -> ReplicaView:
        stats = replica.routing_stats or {}
        queued = self.replica_queue_len_cache.get(replica.replica_id)
        if queued is None:
            queued = int(stats.get("queued", 0))
        # No "chains": no report yet, or the last one failed; the replica is routed to by load alone.
        return ReplicaView(replica.replica_id.unique_id, queued, frozenset(stats.get("chains", ())),
                           frozenset(stats.get("contents", ())), reachable="chains" in stats)


def _routed(pending: PendingRequest | None) -> RoutedRequest | None:
    """The RoutedRequest among the call's arguments, recognised by its fields: the ingress's class reaches this
    process pickled by value with the ingress, so it is a copy of this module's RoutedRequest, not the class itself."""
    args = pending.args if pending is not None else ()
    return next((arg for arg in args if all(hasattr(arg, name) for name in ("http", "keys", "pin"))), None)


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in turn (by replica id), whatever it holds: the cache-blind baseline that
    `kvboost bench cluster` compares routers with. Ray may ask again for a request whose first choice is full."""

    def initialize_state(self, **kwargs) -> None:
        self.turn = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        first = ordered[self.turn % len(ordered)]
        self.turn += 1
        return [[first], [r for r in ordered if r is not first]]
