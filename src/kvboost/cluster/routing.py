"""Which replica should serve a request: the one holding the longest run of its chunks, unless load says otherwise.

A request's chunks are keyed as each replica's engine keys them (chunking.Chunker: a prefix-chain key per chunk,
which names the chunk and everything before it, and a position-free content key). Each replica reports the short
forms of the keys it holds (`short_key`: 64 bits of each). A replica's score for a request is
  exact   = how many of the request's leading chunks it holds as one unbroken chain (reused as they are), then
  content = how many of the remaining chunks it holds anywhere by content (reused at another position; only for
            requests that ask for content reuse),
compared in that order. The best-scoring replica wins unless it has `imbalance` or more requests queued beyond the
least-loaded one: then the least-loaded replica takes it (K/V can be recomputed; a queue cannot be skipped). A request
nothing is cached for goes to the least-loaded replica, ties broken by rendezvous hashing on its first chunk, so a new
conversation's later turns meet their first turn's K/V even before any report shows it. Replicas whose report could
not be read are routed by load alone. No Ray here: the Ray Serve router calls `choose`.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import xxhash

from ..chunking import Chunker

SHORT_KEY_HEX = 16  # 64 bits of a chunk key: a replica's report stays small, collisions stay negligible


def short_key(key: str) -> str:
    return key[:SHORT_KEY_HEX]


@dataclass(frozen=True)
class RequestKeys:
    """A request's complete chunks, in order: prefix-chain keys and content keys (short forms)."""

    chains: tuple[str, ...]
    contents: tuple[str, ...]
    content_reuse: bool = False

    @classmethod
    def of(cls, chunker: Chunker, token_ids: Sequence[int], salt: str | None = None,
           content_reuse: bool = False) -> RequestKeys:
        chunks = chunker.split(token_ids, salt, include_partial=False)
        return cls(tuple(short_key(c.prefix_key) for c in chunks), tuple(short_key(c.content_key) for c in chunks),
                   content_reuse)


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica: its load and the short keys it reported."""

    name: str
    queued: int  # requests waiting or running there
    chains: frozenset[str] = field(default_factory=frozenset)
    contents: frozenset[str] = field(default_factory=frozenset)
    reachable: bool = True  # False: its report could not be read; it is routed to by load alone


@dataclass(frozen=True)
class RoutingPolicy:
    imbalance: int = 4  # queued requests beyond the least-loaded replica's at which load wins over cached K/V

    def __post_init__(self) -> None:
        if self.imbalance < 1:
            raise ValueError(f"imbalance must be >= 1, got {self.imbalance}")


@dataclass(frozen=True)
class Route:
    replica: str
    reason: str  # "prefix", "content", "no match", "imbalanced"
    exact_chunks: int = 0
    content_chunks: int = 0


class RecentRoutes:
    """The chunk keys of requests sent to each replica in the last `ttl_s` seconds: the replica holds them (or will,
    once the request is done) before its next report can say so. A conversation's next turn, sent as soon as the
    last one ends, finds its history here."""

    def __init__(self, ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.clock = ttl_s, clock
        self._sent: dict[str, dict[str, float]] = {}  # replica -> {short chain or content key: expiry}

    def add(self, replica: str, keys: RequestKeys) -> None:
        expiry = self.clock() + self.ttl_s
        self._sent.setdefault(replica, {}).update(dict.fromkeys(keys.chains + keys.contents, expiry))

    def view(self, replica: ReplicaView) -> ReplicaView:
        """`replica` with what was sent to it lately added to what it reported (an unreachable one stays so)."""
        sent = self._sent.get(replica.name)
        if not sent or not replica.reachable:
            return replica
        now = self.clock()
        self._sent[replica.name] = sent = {k: expiry for k, expiry in sent.items() if expiry > now}  # expired: out
        return replace(replica, chains=frozenset(replica.chains | sent.keys()),
                       contents=frozenset(replica.contents | sent.keys()))


def score(request: RequestKeys, replica: ReplicaView) -> tuple[int, int]:
    """(exact, content): the unbroken run of leading chunks held, then the rest of the chunks held by content."""
    if not replica.reachable:
        return 0, 0
    exact = next((i for i, key in enumerate(request.chains) if key not in replica.chains), len(request.chains))
    content = sum(key in replica.contents for key in request.contents[exact:]) if request.content_reuse else 0
    return exact, content


def choose(request: RequestKeys, replicas: Sequence[ReplicaView], policy: RoutingPolicy = RoutingPolicy()) -> Route:
    if not replicas:
        raise ValueError("no replica to route to")
    least = min(r.queued for r in replicas)
    scored = [(score(request, r), r) for r in replicas]
    (exact, content), best = max(scored, key=lambda s: (s[0], -s[1].queued, rendezvous(request, s[1].name)))
    if not (exact or content) or best.queued - least >= policy.imbalance:
        lightest = max((r for r in replicas if r.queued == least), key=lambda r: rendezvous(request, r.name))
        return Route(lightest.name, "imbalanced" if exact or content else "no match")
    return Route(best.name, "prefix" if exact else "content", exact, content)


def rendezvous(request: RequestKeys, name: str) -> int:
    """A stable preference of this request for this replica (highest random weight), from its first chunk."""
    return xxhash.xxh3_64_intdigest(f"{request.chains[0] if request.chains else ''}|{name}".encode())
