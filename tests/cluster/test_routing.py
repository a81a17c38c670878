"""cluster/routing.py: the replica holding the longest unbroken run of a request's chunks wins, content matches
count after exact ones and only when asked, load wins past the imbalance threshold, unreachable replicas are routed
by load alone, and cold requests spread by load but stick to one replica per conversation. A simulation of chat
traffic over four replicas: KV-aware routing finds every reusable chunk where it sends the request, round-robin two
thirds (the shared system prompt is on every replica, each conversation's own history on one)."""
from __future__ import annotations

import random
from collections import OrderedDict, deque

import pytest

from kvboost.chunking import Chunker
from kvboost.cluster.routing import (
    RecentRoutes,
    ReplicaView,
    RequestKeys,
    RoutingPolicy,
    choose,
    score,
    short_key,
)

CHUNKER = Chunker(16, "kvb1|test|float32|c16|w0|b16")


def _keys(ids: list[int], content_reuse: bool = False) -> RequestKeys:
    return RequestKeys.of(CHUNKER, ids, content_reuse=content_reuse)


def _holding(name: str, ids: list[int], queued: int = 0, **kw) -> ReplicaView:
    keys = _keys(ids)
    return ReplicaView(name, queued, frozenset(keys.chains), frozenset(keys.contents), **kw)


SYSTEM = list(range(1000, 1064))  # four chunks
OTHER = list(range(2000, 2064))


def test_keys_are_the_engines_chunk_keys():
    keys = _keys(SYSTEM + [5, 6, 7])  # the incomplete tail has no key
    chunks = CHUNKER.split(SYSTEM, include_partial=False)
    assert keys.chains == tuple(short_key(c.prefix_key) for c in chunks) and len(keys.chains) == 4
    assert _keys(SYSTEM, content_reuse=True).content_reuse


def test_the_longest_unbroken_run_wins():
    request = _keys(SYSTEM + OTHER)
    two = _holding("two", SYSTEM[:32])
    four = _holding("four", SYSTEM)
    broken = ReplicaView("broken", 0, frozenset(request.chains[1:]))  # all but the first chunk: no usable run
    assert score(request, broken) == (0, 0)
    route = choose(request, [two, broken, four])
    assert (route.replica, route.reason, route.exact_chunks) == ("four", "prefix", 4)


def test_content_matches_count_after_exact_ones_and_only_when_asked():
    moved = OTHER + SYSTEM  # SYSTEM's tokens at another position: other chain keys, same content keys
    holder = _holding("holder", SYSTEM)
    cold = ReplicaView("cold", 0)
    assert choose(_keys(moved), [cold, holder]).reason == "no match"
    route = choose(_keys(moved, content_reuse=True), [cold, holder])
    assert (route.replica, route.reason, route.content_chunks) == ("holder", "content", 4)
    exact = _holding("exact", OTHER)  # one exact run beats more content matches
    assert choose(_keys(moved, content_reuse=True), [holder, exact]).replica == "exact"


def test_load_wins_past_the_imbalance_threshold():
    request = _keys(SYSTEM)
    idle = ReplicaView("idle", 1)
    assert choose(request, [_holding("busy", SYSTEM, queued=4), idle]).replica == "busy"  # 3 beyond: below 4
    route = choose(request, [_holding("busy", SYSTEM, queued=5), idle])
    assert (route.replica, route.reason) == ("idle", "imbalanced")
    assert choose(request, [_holding("busy", SYSTEM, queued=5), idle], RoutingPolicy(imbalance=8)).replica == "busy"
    with pytest.raises(ValueError, match="imbalance"):
        RoutingPolicy(imbalance=0)


def test_an_unreachable_replica_is_routed_by_load_alone():
    request = _keys(SYSTEM)
    stale = _holding("stale", SYSTEM, queued=2, reachable=False)
    assert choose(request, [stale, ReplicaView("fresh", 1)]).replica == "fresh"
    assert choose(request, [stale, ReplicaView("busy", 3)]).replica == "stale"  # the least loaded all the same
    with pytest.raises(ValueError, match="no replica"):
        choose(request, [])


def test_cold_requests_spread_by_load_and_stick_per_conversation():
    replicas = [ReplicaView(f"r{i}", 0) for i in range(4)]
    firsts = [list(range(i * 100, i * 100 + 32)) for i in range(40)]
    picked = [choose(_keys(ids), replicas).replica for ids in firsts]
    assert len(set(picked)) == 4  # spread over every replica
    for ids, replica in zip(firsts, picked):  # a later turn, before any report shows the first: the same replica
        assert choose(_keys(ids + list(range(5000, 5040))), replicas).replica == replica
    busy = [ReplicaView("r0", 2), ReplicaView("r1", 0)]
    assert all(choose(_keys(ids), busy).replica == "r1" for ids in firsts)


def _simulate(route_kv: bool, replicas: int = 4, conversations: int = 24, turns: int = 6) -> float:
    """Chats with a shared system prompt and their own history, turns interleaved; each replica's cache holds what it
    served (reports up to date). Returns the share of reusable prompt chunks (held by some replica, as one run from the
    start) found in the chosen replica's cache."""
    rng = random.Random(0)
    held: dict[str, set[str]] = {f"r{i}": set() for i in range(replicas)}
    history = {c: SYSTEM + rng.sample(range(3000, 9000), 24) for c in range(conversations)}
    order = [c for _ in range(turns) for c in rng.sample(range(conversations), conversations)]
    found = reusable = 0
    for n, c in enumerate(order):
        history[c] = history[c] + rng.sample(range(10000, 20000), 40)  # the user's turn and the reply to it
        keys = _keys(history[c])
        if route_kv:
            views = [ReplicaView(name, 0, frozenset(chains)) for name, chains in held.items()]
            name = choose(keys, views).replica
        else:
            name = f"r{n % replicas}"
        found += score(keys, ReplicaView(name, 0, frozenset(held[name])))[0]
        reusable += score(keys, ReplicaView("any", 0, frozenset(set().union(*held.values()))))[0]
        held[name].update(keys.chains)
    return found / reusable


def test_kv_aware_routing_serves_the_history_a_round_robin_misses():
    kv_aware, round_robin = _simulate(True), _simulate(False)
    assert kv_aware == 1.0 and round_robin < 0.7  # 0.65: the shared system prompt is on every replica


def _simulate_at_scale(router: str, replicas: int = 256, conversations: int = 1536, turns: int = 5,
                       capacity: int = 96, report_every: int = 64, in_flight: int = 512,
                       imbalance: int = 2) -> tuple[float, float]:
    """Chats over 16 shared system prompts, turns interleaved; each replica's cache is an LRU of `capacity` chunk keys;
    a request stays in flight for `in_flight` arrivals (about 2 per replica). router: "kv" (choose() over reports
    refreshed every `report_every` requests), "oracle" (choose() over every cache as it is now) or "p2c" (power of two
    choices, Ray's default). Returns (the share of prompt chunks found in the chosen replica's cache, the busiest
    replica's requests over the mean)."""
    rng = random.Random(0)
    names = [f"r{i}" for i in range(replicas)]
    cache: dict[str, OrderedDict[str, None]] = {n: OrderedDict() for n in names}
    report = {n: frozenset() for n in names}
    queued, served = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    finishing: deque[tuple[int, str]] = deque()
    systems = [list(range(100_000 + s * 1000, 100_064 + s * 1000)) for s in range(16)]
    history = {c: systems[c % 16] + rng.sample(range(3000, 90_000), 8) for c in range(conversations)}
    order = [c for _ in range(turns) for c in rng.sample(range(conversations), conversations)]
    policy, found, total = RoutingPolicy(imbalance), 0, 0
    for i, c in enumerate(order):
        if i % report_every == 0:
            report = {n: frozenset(cache[n]) for n in names}
        while finishing and finishing[0][0] <= i:
            queued[finishing.popleft()[1]] -= 1
        history[c] = history[c] + rng.sample(range(100, 90_000), 40)
        keys = _keys(history[c])
        if router == "p2c":
            a, b = rng.sample(names, 2)
            name = a if queued[a] <= queued[b] else b
        else:
            held = report if router == "kv" else {n: cache[n].keys() for n in names}
            name = choose(keys, [ReplicaView(n, queued[n], held[n]) for n in names], policy).replica
        found += score(keys, ReplicaView(name, 0, cache[name].keys()))[0]
        total += len(keys.chains)
        for key in keys.chains:
            cache[name][key] = None
            cache[name].move_to_end(key)
        while len(cache[name]) > capacity:
            cache[name].popitem(last=False)
        queued[name] += 1
        served[name] += 1
        finishing.append((i + in_flight, name))
    return found / total, max(served.values()) / (len(order) / replicas)


def test_at_256_replicas_routing_from_reports_nears_an_oracle_and_keeps_load_even():
    (kv_hits, kv_load), (oracle_hits, _) = _simulate_at_scale("kv"), _simulate_at_scale("oracle")
    p2c_hits, _ = _simulate_at_scale("p2c")
    assert kv_hits >= 0.95 * oracle_hits  # reports a few requests old cost next to nothing
    assert kv_load <= 1.3
    assert kv_hits >= 3 * p2c_hits


def test_what_was_sent_lately_counts_as_held_until_it_expires():
    now = [0.0]
    recent = RecentRoutes(ttl_s=10.0, clock=lambda: now[0])
    first = _keys(SYSTEM)
    replicas = [ReplicaView("a", 1), ReplicaView("b", 0)]  # no report shows anything yet; "b" is less loaded
    assert choose(_keys(SYSTEM + OTHER), replicas).replica == "b"
    recent.add("a", first)  # the conversation's first turn went to "a"
    views = [recent.view(r) for r in replicas]
    route = choose(_keys(SYSTEM + OTHER), views)  # its next turn, before "a" reports: back to "a"
    assert (route.replica, route.reason, route.exact_chunks) == ("a", "prefix", 4)
    assert recent.view(ReplicaView("a", 1, reachable=False)).chains == frozenset()  # unreachable: load alone
    now[0] = 10.5
    assert choose(_keys(SYSTEM + OTHER), [recent.view(r) for r in replicas]).replica == "b"  # expired
