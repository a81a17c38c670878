"""`kvboost bench cluster --simulate R`: the routing policies over R simulated replicas, on a trace of 10k+ chats.

No model and no Ray: each replica is a queue with `slots` requests served at once and an LRU of `capacity` chunk keys;
a request's service time comes from measured costs (benchmarks/results/prefix.json and decode.json: prefill of an
uncached token, placement of a cached one, one decode step). The trace: conversations start as a Poisson stream, each
opening with one of `system_prompts` shared system prompts, each next turn sent a think time after the last reply.
The arrival rate keeps every replica count at the same offered load (`utilization`).

Routers: KVBoost's (kvboost.cluster.routing's policy over what replicas reported at their last report, plus what
was sent to them since, as the Ray router sees it), an oracle (the same policy over every cache as it is at that
moment), power of two choices (Ray Serve's default) and round-robin. At hundreds of replicas `routing.choose` over
every replica per request is too slow for a Python simulation, so `IndexedChooser` finds the same replica through
an index of who holds each key (tests/bench/test_cluster_sim.py checks it decision by decision against `choose`).
"""
from __future__ import annotations

import heapq
import json
import random
import statistics
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvboost.cluster.routing import ReplicaView, RequestKeys, RoutingPolicy, choose, rendezvous

ROUTERS = ("kvboost", "oracle", "power-of-two", "round-robin")
RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class ServiceCosts:
    """Milliseconds per uncached prompt token, per cached (placed) prompt token, per generated token."""

    prefill_ms: float
    cached_ms: float
    decode_ms: float
    source: str = "measured"

    @classmethod
    def measured(cls, results: Path = RESULTS) -> ServiceCosts:
        """From `kvboost bench prefix` (its 1k row: full prefill, and the from-store TTFT less its uncached tokens)
        and `kvboost bench decode` (KVBoost's default row, "kvboost auto")."""
        row = json.loads((results / "prefix.json").read_text())["rows"][0]
        prefill = row["baseline_ms"] / row["prompt_tokens"]
        uncached = row["prompt_tokens"] - row["cached_tokens"]
        cached = max(0.0, row["kvboost_store_ms"] - uncached * prefill) / row["cached_tokens"]
        rows = json.loads((results / "decode.json").read_text())["rows"]
        tok_s = next(r["decode_tok_s"] for r in rows if r["system"] == "kvboost auto")
        return cls(prefill, cached, 1e3 / tok_s, "benchmarks/results/prefix.json, decode.json")


@dataclass(frozen=True)
class Trace:
    """How many chats, over how many shared system prompts, cut into chunks of how many tokens; one seed for all."""

    conversations: int = 10_240
    system_prompts: int = 64
    chunk_size: int = 128
    seed: int = 0


@dataclass
class Request:
    conversation: int
    turn: int
    arrival_s: float
    keys: RequestKeys  # the prompt's complete chunks
    reply_keys: tuple[str, ...]  # chunks completed once the reply is appended (stored when it finishes)
    prompt_tokens: int
    reply_tokens: int
    chat: Conversation | None = None
    replica: int = -1
    cached_chunks: int = 0
    start_s: float = 0.0
    ttft_s: float = 0.0


class Conversation:
    """Token counts only: chunk i of the history is keyed by what it contains (shared system prompt or this chat)."""

    def __init__(self, index: int, system: int, system_tokens: int, rng: random.Random, trace: Trace):
        self.index, self.system, self.rng, self.trace = index, system, rng, trace
        self.turns = rng.randint(2, 8)
        self.sent = 0  # turns sent so far
        self.system_tokens = system_tokens
        self.tokens = system_tokens

    def _keys(self, tokens: int) -> tuple[str, ...]:
        size = self.trace.chunk_size
        return tuple(f"s{self.system}:{i}" if (i + 1) * size <= self.system_tokens else f"c{self.index}:{i}"
                     for i in range(tokens // size))

    def next_request(self, turn: int, now: float) -> Request:
        self.tokens += self.rng.randint(20, 200)  # the user's message
        prompt = self.tokens
        reply = self.rng.randint(30, 300)
        self.tokens += reply
        keys = self._keys(prompt)
        return Request(self.index, turn, now, RequestKeys(keys, keys), self._keys(self.tokens)[len(keys):], prompt,
                       reply, self)


class HeldIndex:
    """Which replicas hold each short key (as a router sees them)."""

    def __init__(self) -> None:
        self.holders: dict[str, set[int]] = {}

    def add(self, key: str, replica: int) -> None:
        self.holders.setdefault(key, set()).add(replica)

    def remove(self, key: str, replica: int) -> None:
        held = self.holders.get(key)
        if held is not None:
            held.discard(replica)
            if not held:
                del self.holders[key]

    def holds(self, key: str, replica: int) -> bool:
        return replica in self.holders.get(key, ())


class IndexedChooser:
    """`routing.choose` over replicas named by index, from `HeldIndex`es instead of a view per replica: the replica
    holding the longest unbroken run of the request's chunks, then the least queued, then rendezvous; the least
    loaded (rendezvous among ties) when nothing matches or the winner is `imbalance` or more beyond it."""

    def __init__(self, replicas: int, policy: RoutingPolicy):
        self.names = [f"r{i}" for i in range(replicas)]
        self.policy = policy
        self.queued = [0] * replicas
        self.by_load: list[set[int]] = [set(range(replicas))]

    def load(self, replica: int, delta: int) -> None:
        q = self.queued[replica]
        self.by_load[q].discard(replica)
        q += delta
        self.queued[replica] = q
        while len(self.by_load) <= q:
            self.by_load.append(set())
        self.by_load[q].add(replica)

    def least(self) -> int:
        return next(q for q, replicas in enumerate(self.by_load) if replicas)

    def choose(self, request: RequestKeys, indexes: Iterable[HeldIndex]) -> tuple[int, str]:
        indexes = list(indexes)
        run: set[int] = set()
        for i, key in enumerate(request.chains):
            holders = set().union(*(ix.holders.get(key, ()) for ix in indexes))
            narrowed = holders if i == 0 else run & holders
            if not narrowed:
                break
            run = narrowed
        least = self.least()
        if not run:
            return self._least_loaded(request, least), "no match"
        best = max(run, key=lambda r: (-self.queued[r], rendezvous(request, self.names[r])))
        if self.queued[best] - least >= self.policy.imbalance:
            return self._least_loaded(request, least), "imbalanced"
        return best, "prefix"

    def _least_loaded(self, request: RequestKeys, least: int) -> int:
        return max(self.by_load[least], key=lambda r: rendezvous(request, self.names[r]))


@dataclass
class Replica:
    capacity: int
    slots: int
    cache: OrderedDict[str, None] = field(default_factory=OrderedDict)
    waiting: deque[Request] = field(default_factory=deque)
    running: int = 0
    served: int = 0


@dataclass
class SimResult:
    router: str
    replicas: int
    conversations: int
    requests: int
    cached_share: float  # prompt chunks found in the chosen replica's cache, of all complete prompt chunks
    busiest_over_mean: float  # requests served by the busiest replica over the mean
    ttft_p50_ms: float
    ttft_p99_ms: float
    utilization: float  # busy slot-seconds over all slot-seconds until the last request finished


class Simulation:
    REPORT_S = 1.0  # replicas report their keys every second (cluster/held_keys.py)
    RECENT_S = 10.0  # keys sent to a replica count as held this long (routing.RecentRoutes)

    def __init__(self, router: str, replicas: int, trace: Trace, costs: ServiceCosts, *, capacity: int = 512,
                 slots: int = 4, utilization: float = 0.7, think_s: float = 20.0, imbalance: int = 4,
                 check_against_choose: bool = False):
        if router not in ROUTERS:
            raise ValueError(f"unknown router {router!r}: one of {', '.join(ROUTERS)}")
        self.router, self.trace, self.costs, self.think_s = router, trace, costs, think_s
        self.replicas = [Replica(capacity, slots) for _ in range(replicas)]
        self.chooser = IndexedChooser(replicas, RoutingPolicy(imbalance))
        self.live = HeldIndex()  # every cache as it is now (the oracle's view)
        self.reported = HeldIndex()  # as of each replica's last report
        self.pending: list[list[tuple[bool, str]]] = [[] for _ in range(replicas)]  # changes since the last report
        self.recent = HeldIndex()
        self.recent_expiry: deque[tuple[float, str, int]] = deque()
        self.recent_until: dict[tuple[str, int], float] = {}  # the latest expiry: a key sent again lives on
        self.think_rng = random.Random(trace.seed + 1)  # apart from routing's: every router sees the same trace
        self.route_rng = random.Random(trace.seed + 2)
        self.busy_s = self.end_s = 0.0
        self.check = check_against_choose
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = 0
        self.done: list[Request] = []
        self.rr = 0
        # The trace's means (Conversation): 5 turns; a prompt of ~1,560 tokens whose last turn (~385 tokens) is new;
        # a reply of 165 tokens. The offered load is set from them; the result reports the load as it happened.
        service_s = self._service_s(385, 1175, 165)
        self.conversation_rate = utilization * replicas * slots / service_s / 5

    # ---- events -----------------------------------------------------------------------------
    def _push(self, when: float, kind: str, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, payload))

    def run(self) -> SimResult:
        rng = random.Random(self.trace.seed)
        systems = [rng.randint(300, 1500) for _ in range(self.trace.system_prompts)]
        now = 0.0
        for c in range(self.trace.conversations):
            now += rng.expovariate(self.conversation_rate)
            s = rng.randrange(self.trace.system_prompts)
            conv = Conversation(c, s, systems[s], random.Random(self.trace.seed * 1_000_003 + c), self.trace)
            self._push(now, "turn", conv)
        next_report = self.REPORT_S
        while self.events:
            when, _, kind, payload = heapq.heappop(self.events)
            while next_report <= when:
                self._report()
                next_report += self.REPORT_S
            if kind == "turn":
                conv = payload
                self._arrive(conv.next_request(conv.sent, when), when)
                conv.sent += 1
            else:
                self._finish(payload, when)
        return self._result()

    def _arrive(self, request: Request, now: float) -> None:
        r = self._route(request, now)
        request.replica = r
        self.chooser.load(r, +1)
        replica = self.replicas[r]
        if replica.running < replica.slots:
            self._start(request, now)
        else:
            replica.waiting.append(request)

    def _start(self, request: Request, now: float) -> None:
        replica = self.replicas[request.replica]
        replica.running += 1
        found = 0
        for key in request.keys.chains:
            if key not in replica.cache:
                break
            found += 1
        request.cached_chunks, request.start_s = found, now
        cached_tokens = found * self.trace.chunk_size
        prefill_s = self._service_s(request.prompt_tokens - cached_tokens, cached_tokens, 0)
        request.ttft_s = now - request.arrival_s + prefill_s
        self._store(request.replica, request.keys.chains)
        service_s = prefill_s + self._service_s(0, 0, request.reply_tokens)
        self.busy_s += service_s
        self._push(now + service_s, "finish", request)

    def _finish(self, request: Request, now: float) -> None:
        replica = self.replicas[request.replica]
        replica.running -= 1
        replica.served += 1
        self.end_s = now
        self.chooser.load(request.replica, -1)
        self._store(request.replica, request.reply_keys)
        self.done.append(request)
        if request.chat.sent < request.chat.turns:
            self._push(now + self.think_rng.expovariate(1 / self.think_s), "turn", request.chat)
        if replica.waiting:
            self._start(replica.waiting.popleft(), now)

    def _service_s(self, uncached: float, cached: float, generated: float) -> float:
        c = self.costs
        return (uncached * c.prefill_ms + cached * c.cached_ms + generated * c.decode_ms) / 1e3

    # ---- caches and what the router knows ---------------------------------------------------------
    def _store(self, r: int, keys: Iterable[str]) -> None:
        cache = self.replicas[r].cache
        for key in keys:
            if key in cache:
                cache.move_to_end(key)
                continue
            cache[key] = None
            self.live.add(key, r)
            self.pending[r].append((True, key))
        while len(cache) > self.replicas[r].capacity:
            key, _ = cache.popitem(last=False)
            self.live.remove(key, r)
            self.pending[r].append((False, key))

    def _report(self) -> None:
        for r, changes in enumerate(self.pending):
            for added, key in changes:
                (self.reported.add if added else self.reported.remove)(key, r)
            changes.clear()

    def _route(self, request: Request, now: float) -> int:
        n = len(self.replicas)
        if self.router == "round-robin":
            self.rr = (self.rr + 1) % n
            return self.rr
        if self.router == "power-of-two":
            a, b = self.route_rng.sample(range(n), 2)
            return a if self.chooser.queued[a] <= self.chooser.queued[b] else b
        if self.router == "oracle":
            return self.chooser.choose(request.keys, [self.live])[0]
        while self.recent_expiry and self.recent_expiry[0][0] <= now:
            expiry, key, r = self.recent_expiry.popleft()
            if self.recent_until.get((key, r)) == expiry:
                del self.recent_until[(key, r)]
                self.recent.remove(key, r)
        r, _ = self.chooser.choose(request.keys, [self.reported, self.recent])
        if self.check:
            self._check(request.keys, r)
        for key in request.keys.chains:
            self.recent.add(key, r)
            self.recent_until[(key, r)] = now + self.RECENT_S
            self.recent_expiry.append((now + self.RECENT_S, key, r))
        return r

    def _check(self, keys: RequestKeys, picked: int) -> None:
        """The index's choice is `routing.choose`'s over one view per replica."""
        views = []
        for r, name in enumerate(self.chooser.names):
            held = frozenset(k for k in keys.chains if self.reported.holds(k, r) or self.recent.holds(k, r))
            views.append(ReplicaView(name, self.chooser.queued[r], held))
        want = choose(keys, views, self.chooser.policy).replica
        if want != self.chooser.names[picked]:
            raise AssertionError(f"indexed choice {self.chooser.names[picked]} != choose()'s {want}")

    def _result(self) -> SimResult:
        total = sum(len(r.keys.chains) for r in self.done)
        found = sum(r.cached_chunks for r in self.done)
        served = [r.served for r in self.replicas]
        ttft = sorted(r.ttft_s * 1e3 for r in self.done)
        slot_s = sum(r.slots for r in self.replicas) * self.end_s
        return SimResult(self.router, len(self.replicas), self.trace.conversations, len(self.done),
                         found / max(total, 1),
                         max(served) / (len(self.done) / len(served)), statistics.median(ttft),
                         ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))], self.busy_s / slot_s)


PER_REPLICA = 40  # conversations per replica at least: every replica count sees the same traffic per replica


def run_simulations(replica_counts: list[int], trace: Trace, costs: ServiceCosts, *, capacity: int, slots: int,
                    utilization: float, imbalance: int, progress=None) -> list[SimResult]:
    results = []
    for n in replica_counts:
        scaled = replace(trace, conversations=max(trace.conversations, PER_REPLICA * n))
        for router in ROUTERS:
            results.append(Simulation(router, n, scaled, costs, capacity=capacity, slots=slots,
                                      utilization=utilization, imbalance=imbalance).run())
            if progress:
                progress(results[-1])
    return results


def sim_record(results: list[SimResult], trace: Trace, costs: ServiceCosts, **settings) -> dict:
    return {"benchmark": "cluster-simulate", "trace": asdict(trace), "costs": asdict(costs), **settings,
            "results": [asdict(r) for r in results]}


def plot_simulations(results: list[SimResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.8))
    for router in ROUTERS:
        rows = [r for r in results if r.router == router]
        xs = [r.replicas for r in rows]
        a.plot(xs, [r.cached_share for r in rows], marker="o", label=router)
        b.plot(xs, [r.busiest_over_mean for r in rows], marker="o", label=router)
        c.plot(xs, [r.ttft_p50_ms for r in rows], marker="o", label=router)
    for ax, label in ((a, "prompt chunks found in the chosen replica"), (b, "busiest replica, requests / mean"),
                      (c, "TTFT p50 (ms, simulated)")):
        ax.set_xscale("log", base=2)
        counts = sorted({r.replicas for r in results})
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_xlabel("replicas")
        ax.set_ylabel(label)
    a.set_ylim(0, 1)
    a.legend()
    fig.suptitle("kvboost bench cluster --simulate: routing policies over simulated replicas")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
