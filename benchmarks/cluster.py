"""`kvboost bench cluster`: one replay against KVBoost replicas on a local Ray cluster (kvboost serve --replicas),
routed by KVBoost's router, by Ray Serve's default (power of two choices) and round-robin, and against a single
replica: the share of prompt tokens served from cached K/V, TTFT p50 / p99 and requests per second.

Each configuration is deployed fresh (empty caches) and replays the same requests (benchmarks/data): multi-turn
conversations, their turns in order, and shared-document RAG questions (one document, then the question; each
document asked about by several requests spread over the replay), all interleaved (`clients` threads each send the
turn that has waited longest, streamed, the model's own greedy reply appended to a conversation's history as a chat
client does). Every replica gets `cpus_per_replica` cores (OpenMP threads)."""
from __future__ import annotations

import json
import queue
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass

import typer

from .console import bench_console

CONFIGS = (("kvboost", 2), ("power-of-two", 2), ("round-robin", 2), ("single", 1))
RAG_SYSTEM = "Answer the question from the document below, in one short sentence.\n\n"


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float
    replica: str | None
    kind: str = "chat"  # "chat" (a conversation's turn) or "rag" (a shared-document question)


@dataclass
class ConfigResult:
    name: str
    replicas: int
    turns: list[Turn]
    seconds: float = 0.0  # the replay's wall time

    @property
    def cached_share(self) -> float:
        return _share(self.turns)

    def ttft_p50(self, later_turns_only: bool = False) -> float:
        return statistics.median(t.ttft_ms for t in self.turns if t.turn > 0 or not later_turns_only)

    def ttft_p99(self) -> float:
        ordered = sorted(t.ttft_ms for t in self.turns)
        return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]

    def summary(self) -> dict:
        return {"name": self.name, "replicas": self.replicas, "cached_share": self.cached_share,
                "cached_share_chat": _share([t for t in self.turns if t.kind == "chat"]),
                "cached_share_rag": _share([t for t in self.turns if t.kind == "rag"]),
                "ttft_p50_ms": self.ttft_p50(), "ttft_p99_ms": self.ttft_p99(),
                "ttft_p50_later_turns_ms": self.ttft_p50(True),
                "requests_per_s": len(self.turns) / self.seconds if self.seconds else None,
                "requests_per_replica": sorted(_count(t.replica for t in self.turns).values(), reverse=True)}


def _share(turns: list[Turn]) -> float:
    return sum(t.cached_tokens for t in turns) / max(1, sum(t.prompt_tokens for t in turns))


def rag_requests(n: int) -> list[dict]:
    """n single-turn requests over shared documents (those asked about most, each answering two or more questions):
    the document first (as the system message), then one question; ordered so that one document's questions are
    spread over the replay (every document's first question, then every second one, ...)."""
    from .rag import doc_text
    from .workloads import load_rag

    docs, items = load_rag()
    by_doc: dict[str, list[str]] = {}
    for item in items:
        by_doc.setdefault(item["answer_doc_id"], []).append(item["question"])
    shared = []  # the documents asked about most, until they hold n questions
    for doc, questions in sorted(by_doc.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        if len(questions) < 2 or sum(len(q) for _, q in shared) >= n:
            break
        shared.append((doc, questions))
    out = []
    for k in range(max((len(q) for _, q in shared), default=0)):
        out += [{"system": RAG_SYSTEM + doc_text(docs[doc]), "turns": [q[k]], "kind": "rag"}
                for doc, q in shared if k < len(q)]
    return out[:n]


def interleave(conversations: list[dict], rag: list[dict]) -> list[dict]:
    """Conversations and RAG requests alternated, the longer list's rest at the end."""
    out = []
    for i in range(max(len(conversations), len(rag))):
        out += [c[i] for c in (conversations, rag) if i < len(c)]
    return out


def _count(items) -> dict:
    out: dict = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def _turn(base_url: str, messages: list[dict], max_tokens: int) -> tuple[str, int, int, float, str | None]:
    """One streamed chat turn: (reply, prompt tokens, cached tokens, TTFT ms, replica)."""
    import httpx

    body = {"model": "kvboost", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    reply, usage, ttft = "", None, None
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        replica = r.headers.get("x-kvboost-replica")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the server failed the turn: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft if ttft is not None else (time.perf_counter() - t0) * 1e3
                    reply += choice["delta"]["content"]
    assert usage is not None, "the stream carried no usage"
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return reply, usage["prompt_tokens"], cached, ttft if ttft is not None else (time.perf_counter() - t0) * 1e3, \
        replica


def replay(base_url: str, conversations: list[dict], turns: int, clients: int, max_tokens: int,
           think_s: float = 0.0) -> list[Turn]:
    """Every conversation's turns in order (at most `turns`; a RAG request has one), conversations interleaved:
    `clients` threads take the conversation that has waited longest for its next turn, which is ready a think time
    after the reply to its last one (uniform in [0, think_s], the same in every run: seeded by conversation and turn),
    so consecutive turns of one conversation are sent by whichever client is free, after other conversations'."""
    ready: queue.Queue[tuple[int, int, list[dict]] | None] = queue.Queue()
    for i, c in enumerate(conversations):
        ready.put((i, 0, [{"role": "system", "content": c["system"]}]))
    remaining = [len(conversations)]
    lock = threading.Lock()
    out: list[Turn] = []
    failures: list[BaseException] = []

    def client() -> None:
        while (item := ready.get()) is not None:
            i, t, messages = item
            messages = [*messages, {"role": "user", "content": conversations[i]["turns"][t]}]
            try:
                reply, prompt, cached, ttft, replica = _turn(base_url, messages, max_tokens)
            except BaseException as exc:
                failures.append(exc)
                reply, prompt, cached, ttft, replica, t = "", 0, 0, 0.0, None, turns  # this conversation ends
            else:
                out.append(Turn(i, t, prompt, cached, ttft, replica, conversations[i].get("kind", "chat")))
            if t + 1 < min(turns, len(conversations[i]["turns"])):
                item = (i, t + 1, [*messages, {"role": "assistant", "content": reply}])
                timer = threading.Timer(random.Random(i * 1000 + t).uniform(0, think_s), ready.put, (item,))
                timer.daemon = True
                timer.start()
                continue
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    for _ in range(clients):
                        ready.put(None)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if failures:
        raise failures[0]
    return out


def run_cluster_bench(conversations: int, turns: int, rag: int, clients: int, max_tokens: int,
                      cpus_per_replica: int, imbalance: int, think_s: float, json_path: str | None,
                      plot_path: str | None, memory_budget_mb: int | None = None) -> list[ConfigResult]:
    import os

    import ray
    from ray import serve

    from kvboost.cluster.deploy import ReplicaSpec, build_app
    from kvboost.server.background import bind_socket
    from kvboost.server.settings import ServerSettings

    from .workloads import load_conversations

    console = bench_console()
    chats = [c for c in load_conversations() if len(c["turns"]) >= turns][:conversations]
    requests = interleave(chats, rag_requests(rag))
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    env = {"KVBOOST_AOT": os.environ.get("KVBOOST_AOT", "0")}  # eager steps: no package build in the background
    ray.init(num_cpus=2 * cpus_per_replica, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    results: list[ConfigResult] = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine_options = {"device": "cpu"}
        if memory_budget_mb is not None:  # every replica's memory tier, the single one's too
            engine_options["memory_budget_bytes"] = memory_budget_mb << 20
        spec = ReplicaSpec(ServerSettings(served_model_name="kvboost"), engine_options)
        for name, replicas in CONFIGS:
            router = "kvboost" if name == "single" else name
            with console.status(f"{name}: deploying {replicas} replica(s)"):
                serve.run(build_app(spec, replicas, imbalance, cpus_per_replica=cpus_per_replica, router=router),
                          name="bench", route_prefix="/")
            with console.status(f"{name}: {len(chats)} conversations x {turns} turns and {len(requests) - len(chats)}"
                                f" RAG requests, {clients} clients"):
                t0 = time.perf_counter()
                done = replay(f"http://127.0.0.1:{port}", requests, turns, clients, max_tokens, think_s)
                results.append(ConfigResult(name, replicas, done, time.perf_counter() - t0))
            serve.delete("bench")
            s = results[-1].summary()
            console.print(f"{name}: cached share {s['cached_share']:.3f} (chat {s['cached_share_chat']:.3f}, RAG "
                          f"{s['cached_share_rag']:.3f}), TTFT p50 {s['ttft_p50_ms']:.0f} ms, p99 "
                          f"{s['ttft_p99_ms']:.0f} ms, {s['requests_per_s']:.2f} requests/s, requests per replica "
                          f"{s['requests_per_replica']}")
    finally:
        serve.shutdown()
        ray.shutdown()
    _report(console, results)
    if json_path:
        from .plots import write_json

        write_json(json_path, {"conversations": len(chats), "turns": turns, "rag_requests": len(requests) - len(chats),
                               "clients": clients, "think_s": think_s,
                               "max_tokens": max_tokens, "cpus_per_replica": cpus_per_replica,
                               "imbalance": imbalance, "memory_budget_mb": memory_budget_mb,
                               "configs": [r.summary() for r in results],
                               "turns_detail": {r.name: [asdict(t) for t in r.turns] for r in results}})
    if plot_path:
        _plot(results, plot_path)
    return results


def _report(console, results: list[ConfigResult]) -> None:
    by = {r.name: r for r in results}
    kv, p2c, rr, single = by["kvboost"], by["power-of-two"], by["round-robin"], by["single"]
    console.print(f"KVBoost router: cached share {kv.cached_share / single.cached_share:.2f}x a single replica's, "
                  f"{kv.cached_share / max(p2c.cached_share, 1e-9):.2f}x Ray's default router's, "
                  f"{kv.cached_share / max(rr.cached_share, 1e-9):.2f}x round-robin's; TTFT p50 "
                  f"{kv.ttft_p50() / p2c.ttft_p50():.2f}x the default router's")


def _plot(results: list[ConfigResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.8))
    names = [f"{r.name}\n({r.replicas} replica{'s' if r.replicas > 1 else ''})" for r in results]
    x = range(len(results))
    a.bar(names, [r.cached_share for r in results], color="#4878a8")
    a.set_ylabel("prompt tokens served from cache")
    a.set_ylim(0, 1)
    b.bar([i - 0.2 for i in x], [r.ttft_p50() for r in results], width=0.4, color="#d08040", label="p50")
    b.bar([i + 0.2 for i in x], [r.ttft_p99() for r in results], width=0.4, color="#a05020", label="p99")
    b.set_xticks(list(x), names)
    b.set_ylabel("TTFT (ms)")
    b.legend()
    c.bar(names, [r.summary()["requests_per_s"] or 0 for r in results], color="#60a060")
    c.set_ylabel("requests / s")
    fig.suptitle("kvboost bench cluster: chat and RAG replay, local Ray")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def bench_cluster_command(
    conversations: int = typer.Option(32, min=1, help="Conversations replayed (each with at least --turns turns)."),
    turns: int = typer.Option(4, min=1, help="User turns per conversation."),
    rag: int = typer.Option(32, min=0, help="Shared-document RAG requests interleaved with the conversations."),
    clients: int = typer.Option(4, min=1, help="Concurrent clients, each sending whole conversations."),
    max_tokens: int = typer.Option(16, min=1, help="Reply tokens per turn."),
    cpus_per_replica: int = typer.Option(1, min=1, help="Cores (OpenMP threads) per replica."),
    imbalance: int = typer.Option(4, min=1, help="KVBoost router's --route-imbalance."),
    think_s: float = typer.Option(1.0, min=0.0, help="A conversation's next turn is ready up to this many seconds "
                                                     "after its last reply (uniform, seeded)."),
    memory_budget_mb: int | None = typer.Option(None, min=1, help="Each replica's memory tier in MiB (default: the "
                                                                  "engine's); below the replay's K/V, replicas evict."),
    simulate: str | None = typer.Option(None, "--simulate", metavar="R[,R...]",
                                        help="Instead of Ray: the routers over R simulated replicas each (e.g. "
                                             "64,256,1024), on a trace of --sim-conversations chats (at least 40 "
                                             "per replica), service times from benchmarks/results."),
    sim_conversations: int = typer.Option(10_240, min=1, help="With --simulate: conversations in the trace."),
    sim_capacity: int = typer.Option(512, min=1, help="With --simulate: chunks each replica's cache holds."),
    sim_utilization: float = typer.Option(0.7, min=0.01, max=0.99, help="With --simulate: offered load per "
                                                                         "replica slot (4 slots a replica)."),
    json_path: str | None = typer.Option(None, "--json", help="Write the results here."),
    plot_path: str | None = typer.Option(None, "--plot", help="Write a PNG here."),
) -> None:
    """KVBoost replicas on a local Ray cluster: KVBoost's router vs Ray's default vs round-robin vs one replica
    (cached share, TTFT p50 / p99, requests/s) over chat and RAG requests."""
    replay_only = {"--conversations": conversations != 32, "--turns": turns != 4, "--rag": rag != 32,
                   "--clients": clients != 4, "--max-tokens": max_tokens != 16, "--think-s": think_s != 1.0,
                   "--cpus-per-replica": cpus_per_replica != 1, "--memory-budget-mb": memory_budget_mb is not None}
    sim_only = {"--sim-conversations": sim_conversations != 10_240, "--sim-capacity": sim_capacity != 512,
                "--sim-utilization": sim_utilization != 0.7}
    ignored = [flag for flag, given in (replay_only if simulate is not None else sim_only).items() if given]
    if ignored:  # refused, not silently dropped
        raise typer.BadParameter(f"{', '.join(ignored)} {'do not apply with' if simulate else 'apply only with'} "
                                 "--simulate", param_hint="--simulate")
    if simulate is not None:
        counts = _replica_counts(simulate)
        run_simulation_bench(counts, sim_conversations, sim_capacity, sim_utilization, imbalance, json_path, plot_path)
        return
    from kvboost.extras import require

    require("kvboost bench cluster", "cluster", modules=("httpx",))
    run_cluster_bench(conversations, turns, rag, clients, max_tokens, cpus_per_replica, imbalance, think_s, json_path,
                      plot_path, memory_budget_mb)


def _replica_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 2:
        raise typer.BadParameter(f"{text!r}: replica counts >= 2, comma-separated (e.g. 64,256,1024)",
                                 param_hint="--simulate")
    return counts


def run_simulation_bench(counts: list[int], conversations: int, capacity: int, utilization: float, imbalance: int,
                         json_path: str | None, plot_path: str | None) -> None:
    from .cluster_sim import ServiceCosts, Trace, plot_simulations, run_simulations, sim_record

    console = bench_console()
    costs = ServiceCosts.measured()
    console.print(f"service times from {costs.source}: prefill {costs.prefill_ms:.3f} ms per uncached token, "
                  f"{costs.cached_ms:.3f} per cached one, decode {costs.decode_ms:.1f} ms per token")
    trace = Trace(conversations)

    def show(r) -> None:
        console.print(f"{r.replicas:>5} replicas, {r.router:<12} cached share {r.cached_share:.3f}, busiest "
                      f"{r.busiest_over_mean:.2f}x the mean, TTFT p50 {r.ttft_p50_ms:,.0f} ms, p99 "
                      f"{r.ttft_p99_ms:,.0f} ms, load {r.utilization:.2f} ({r.conversations:,} chats, "
                      f"{r.requests:,} requests)")

    with console.status("simulating"):
        results = run_simulations(counts, trace, costs, capacity=capacity, slots=4, utilization=utilization,
                                  imbalance=imbalance, progress=show)
    by = {(r.replicas, r.router): r for r in results}
    for n in counts:
        kv, oracle, p2c = by[(n, "kvboost")], by[(n, "oracle")], by[(n, "power-of-two")]
        console.print(f"{n} replicas: KVBoost's router finds {kv.cached_share / max(oracle.cached_share, 1e-9):.3f}x "
                      f"the oracle's cached share and {kv.cached_share / max(p2c.cached_share, 1e-9):.2f}x Ray's "
                      f"default router's; busiest replica {kv.busiest_over_mean:.2f}x the mean")
    if json_path:
        from .plots import write_json

        write_json(json_path, sim_record(results, trace, costs, capacity_chunks=capacity, slots=4,
                                         utilization=utilization, imbalance=imbalance))
    if plot_path:
        plot_simulations(results, plot_path)
