"""`kvboost bench cluster --simulate` (benchmarks/cluster_sim.py): the indexed chooser makes routing.choose's decision
at every request, routers see the same trace, KV-aware routing finds what the oracle finds and far more than load
balancers, the costs come from the measured results, and the command writes what it says."""
from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from benchmarks.cluster_sim import (
    ROUTERS,
    HeldIndex,
    IndexedChooser,
    ServiceCosts,
    Simulation,
    Trace,
    run_simulations,
)
from kvboost.cluster.routing import ReplicaView, RequestKeys, RoutingPolicy, choose

COSTS = ServiceCosts(prefill_ms=1.5, cached_ms=0.1, decode_ms=16.0, source="test")


def test_indexed_chooser_equals_choose_on_random_states():
    rng = random.Random(3)
    for _ in range(300):
        n = rng.randint(2, 9)
        chooser = IndexedChooser(n, RoutingPolicy(imbalance=rng.randint(1, 4)))
        index = HeldIndex()
        held: list[set[str]] = [set() for _ in range(n)]
        for r in range(n):
            chooser.load(r, rng.randint(0, 5))
            for i in range(rng.randint(0, 6)):
                key = f"k{rng.randint(0, 2)}:{i}"
                index.add(key, r)
                held[r].add(key)
        chains = tuple(f"k{rng.randint(0, 2)}:{i}" for i in range(rng.randint(1, 6)))
        request = RequestKeys(chains, chains)
        views = [ReplicaView(chooser.names[r], chooser.queued[r], frozenset(held[r])) for r in range(n)]
        picked, _ = chooser.choose(request, [index])
        assert chooser.names[picked] == choose(request, views, chooser.policy).replica


def test_the_simulated_router_decides_as_choose_does_at_every_request():
    # check_against_choose raises on the first decision that differs from routing.choose over one view per replica
    result = Simulation("kvboost", 6, Trace(conversations=150, system_prompts=4), COSTS, capacity=64,
                        check_against_choose=True).run()
    assert result.requests > 150 * 2


def test_routers_over_one_trace():
    results = {r.router: r for r in run_simulations([8], Trace(conversations=320, system_prompts=6), COSTS,
                                                     capacity=96, slots=4, utilization=0.6, imbalance=2)}
    assert set(results) == set(ROUTERS)
    assert len({r.requests for r in results.values()}) == 1  # every router served the same requests
    kv, oracle, p2c, rr = (results[name] for name in ROUTERS)
    assert kv.cached_share >= 0.95 * oracle.cached_share
    assert kv.cached_share >= 1.5 * max(p2c.cached_share, rr.cached_share)
    assert kv.ttft_p50_ms < p2c.ttft_p50_ms
    assert rr.busiest_over_mean <= 1.05 and all(0 < r.utilization < 1 for r in results.values())


def test_unknown_router_is_refused():
    with pytest.raises(ValueError, match="unknown router"):
        Simulation("random", 4, Trace(conversations=10), COSTS)


def test_costs_come_from_the_measured_results(tmp_path):
    (tmp_path / "prefix.json").write_text(json.dumps({"rows": [
        {"prompt_tokens": 1000, "cached_tokens": 900, "baseline_ms": 2000.0, "kvboost_store_ms": 290.0}]}))
    (tmp_path / "decode.json").write_text(json.dumps({"rows": [
        {"system": "kvboost off", "decode_tok_s": 10.0}, {"system": "kvboost auto", "decode_tok_s": 50.0}]}))
    costs = ServiceCosts.measured(tmp_path)
    assert costs.prefill_ms == 2.0 and costs.cached_ms == pytest.approx(90.0 / 900) and costs.decode_ms == 20.0


def test_the_command_simulates_without_ray_and_writes_json(tmp_path, monkeypatch):
    import typer

    from benchmarks import cluster_sim
    from benchmarks.cluster import bench_cluster_command

    monkeypatch.setattr(cluster_sim, "PER_REPLICA", 1)
    app = typer.Typer()
    app.command()(bench_cluster_command)
    out = tmp_path / "sim.json"
    r = CliRunner().invoke(app, ["--simulate", "4,8", "--sim-conversations", "60", "--json", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    rows = [(x["replicas"], x["router"]) for x in data["results"]]
    assert rows == [(n, router) for n in (4, 8) for router in ROUTERS]
    assert "the oracle's cached share" in r.output
    bad = CliRunner().invoke(app, ["--simulate", "1"])
    assert bad.exit_code == 2 and "replica counts" in bad.output
    # options of the other mode are refused, not ignored
    mixed = CliRunner().invoke(app, ["--simulate", "4", "--memory-budget-mb", "64"], env={"COLUMNS": "200"})
    assert mixed.exit_code == 2 and "--memory-budget-mb do not apply with --simulate" in mixed.output
    alone = CliRunner().invoke(app, ["--sim-capacity", "64"], env={"COLUMNS": "200"})
    assert alone.exit_code == 2 and "--sim-capacity apply only with --simulate" in alone.output
