"""Start (or join) Ray, run the replicas' application on `kvboost serve`'s host and port, wait for Ctrl-C."""
from __future__ import annotations

import os
import signal
import threading

import typer

from .deploy import ReplicaSpec, build_app

APP_NAME = "kvboost"


def resources_per_replica(spec: ReplicaSpec, replicas: int) -> tuple[float, float]:
    """(cpus, gpus) for each replica: one GPU each where the engine runs on CUDA, else an equal share of this
    machine's cores (Ray sets each replica's OpenMP threads to its CPUs)."""
    import torch

    device = spec.load.get("device")
    on_cuda = (device or "").startswith("cuda") or (device is None and torch.cuda.is_available())
    return (1.0, 1.0) if on_cuda else (float(max(1, (os.cpu_count() or 1) // replicas)), 0.0)


def serve_replicas(spec: ReplicaSpec, replicas: int, ray_address: str | None, imbalance: int,
                   log_level: str = "info") -> None:
    import ray
    from ray import serve

    from ..server.background import bind_socket

    settings, port = spec.settings, spec.settings.port
    if port == 0:  # Ray's proxy takes a port number: find a free one
        with bind_socket(settings.host, 0) as sock:
            port = sock.getsockname()[1]
    cpus, gpus = resources_per_replica(spec, replicas)
    typer.echo(f"kvboost serve: starting {replicas} replica(s) on Ray Serve "
               f"({'joining ' + ray_address if ray_address else 'a local one-node cluster'}; "
               f"{cpus:g} CPU and {gpus:g} GPU each)")
    ray.init(address=ray_address, include_dashboard=False, logging_level=log_level.upper(),
             runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith("KVBOOST_")}})
    serve.start(http_options={"host": settings.host, "port": port})
    serve.run(build_app(spec, replicas, imbalance, gpus, cpus), name=APP_NAME, route_prefix="/")
    typer.echo(f"KVBoost server listening on http://{settings.host}:{port}  ({replicas} replica(s) of "
               f"'{settings.model_id}', routed by their K/V{', API key required' if settings.api_key else ''})")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    typer.echo("kvboost serve: shutting down the replicas")
    serve.delete(APP_NAME)
    if ray_address is None:  # the cluster is ours
        serve.shutdown()
        ray.shutdown()
