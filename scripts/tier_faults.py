"""Storage tiers under faults, measured: what a request costs, and what a damaged index keeps.

    python scripts/tier_faults.py                 # the embedded SmolLM2-135M, CPU unless --device
    python scripts/tier_faults.py --requests 5 --new-tokens 8 --model PATH

(a) generate() wall time per request (each request a new ~5-chunk document, so each one writes chunks) with
    no Redis, a healthy Redis, a full Redis (--maxmemory 2mb --maxmemory-policy noeviction: every write
    refused with OOM once it fills) and a hung Redis (SIGSTOP);
(b) a warmed disk cache whose index.sqlite3 is then overwritten with garbage: chunk files kept, and the
    hits a new engine gets from them; and the same directory served through a read-only bind mount.
Needs redis-server on PATH for (a)'s Redis rows (they are skipped without it).
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import kvboost
from kvboost import KVBoost
from kvboost.loading import load_model_and_tokenizer

WORDS = ("the quarterly report shows revenue growth across all regions while costs in logistics rose "
         "because fuel prices and shipping delays affected the supply chain of every product line the team "
         "plans to review contracts hire engineers expand the data platform and improve customer support").split()


def document(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


# ---- redis-server ------------------------------------------------------------------------------------
class Redis:
    def __init__(self, workdir: Path, *args: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir), "--logfile", "", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        self.proc.wait(10)


@contextmanager
def redis_for(kind: str, workdir: Path) -> Iterator[str | None]:
    if kind == "none":
        yield None
        return
    args = ("--maxmemory", "2mb", "--maxmemory-policy", "noeviction") if kind == "full" else ()
    server = Redis(workdir, *args)
    try:
        if kind == "hung":
            server.proc.send_signal(signal.SIGSTOP)
        yield server.url
    finally:
        server.stop()


# ---- (a) request latency -------------------------------------------------------------------------------
class StoreClock:
    """Seconds the request thread spends inside the engine's store (writes behind it are not counted):
    unlike wall time, this does not move with what else the machine is running."""

    def __init__(self, store):
        self.seconds = 0.0
        for name in ("get", "put", "contains", "children", "by_content", "delete"):
            if hasattr(store, name):
                setattr(store, name, self._timed(getattr(store, name)))

    def _timed(self, method):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


def latency_rows(model, tokenizer, requests: int, new_tokens: int, workdir: Path) -> list[tuple]:
    """Engines for every Redis state, sharing one model, take turns request by request: on a shared
    machine the noise then falls on every row alike."""
    kinds = ["none"] + (["healthy", "full", "hung"] if shutil.which("redis-server") else [])
    with ExitStack() as stack:
        engines = {}
        for kind in kinds:
            engines[kind] = KVBoost(model, tokenizer, redis_url=stack.enter_context(redis_for(kind, workdir)))
            engines[kind].generate("warm-up: load kernels", 2)  # (not timed)
        clocks = {kind: StoreClock(engine.store) for kind, engine in engines.items()}
        walls: dict[str, list[float]] = {k: [] for k in kinds}
        ttfts: dict[str, list[float]] = {k: [] for k in kinds}
        in_store: dict[str, list[float]] = {k: [] for k in kinds}
        for i in range(requests):
            prompt = document(1000 + i, 450) + "\nQuestion: what rose, and why?"
            for kind, engine in engines.items():
                before = clocks[kind].seconds
                t0 = time.perf_counter()
                result = engine.generate(prompt, new_tokens)
                walls[kind].append(time.perf_counter() - t0)
                ttfts[kind].append(result.ttft_ms / 1e3)
                in_store[kind].append(clocks[kind].seconds - before)
        rows = []
        for kind, engine in engines.items():
            getattr(engine.store, "flush", lambda t: None)(30)
            redis = engine.cache_stats()["tiers"].get("redis", {})
            note = ", ".join(f"{k}={redis[k]}" for k in ("errors", "rejected_writes", "breaker_opened",
                                                          "write_breaker_opened", "dropped_writes") if k in redis)
            rows.append((kind, statistics.median(walls[kind]), max(walls[kind]), statistics.median(ttfts[kind]),
                         statistics.median(in_store[kind]), max(in_store[kind]), note))
            getattr(engine.store, "close", lambda: None)()
    return rows


# ---- (b) damaged index, read-only directory ----------------------------------------------------------
def index_rows(model, tokenizer, new_tokens: int, workdir: Path) -> list[tuple]:
    cache = workdir / "cache"
    doc = document(7, 1500)
    prompt = doc + "\nQuestion: what did the team plan?"
    writer = KVBoost(model, tokenizer, disk_cache_dir=str(cache))
    stored = writer.warm(doc).chunks_stored
    getattr(writer.store, "close", lambda: None)()
    files = sorted(cache.glob("chunks/*/*.kvb"))
    rows = [("warmed", len(files), f"{stored} chunks stored")]

    for suffix in ("-wal", "-shm"):
        (cache / f"index.sqlite3{suffix}").unlink(missing_ok=True)
    index = cache / "index.sqlite3"
    index.write_bytes(os.urandom(index.stat().st_size))  # every byte of the index overwritten
    reader = KVBoost(model, tokenizer, disk_cache_dir=str(cache))
    kept = len(list(cache.glob("chunks/*/*.kvb")))  # (before generate() writes back what it had to recompute)
    result = reader.generate(prompt, new_tokens)
    disk = reader.cache_stats()["tiers"]["disk"]
    rows.append(("index damaged", kept, f"{kept} of {len(files)} files kept; cached_tokens={result.cached_tokens}, "
                 f"disk hits={disk['hits']}, events={disk.get('events')}, swept={disk.get('swept_orphans')}"))
    getattr(reader.store, "close", lambda: None)()

    view = workdir / "ro-view"
    view.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(cache), str(view)], capture_output=True).returncode == 0 and \
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], capture_output=True).returncode == 0
    if mounted:
        try:
            ro = KVBoost(model, tokenizer, disk_cache_dir=str(view))
            result = ro.generate(doc + "\nQuestion: what rose?", new_tokens)  # (a new last chunk: not written)
            getattr(ro.store, "flush", lambda t: None)(10)
            disk = ro.cache_stats()["tiers"]["disk"]
            rows.append(("read-only mount", len(list(view.glob("chunks/*/*.kvb"))),
                         f"cached_tokens={result.cached_tokens}, disk hits={disk['hits']}, "
                         f"read_only={disk.get('read_only')!r}, disabled={disk.get('disabled')!r}, "
                         f"dropped_writes={disk.get('dropped_writes')}"))
            getattr(ro.store, "close", lambda: None)()
        finally:
            subprocess.run(["umount", "-l", str(view)], capture_output=True)
    else:
        rows.append(("read-only mount", "-", "skipped: no mount privileges"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path or id (default: the embedded SmolLM2-135M)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    model, tokenizer = load_model_and_tokenizer(args.model, device=args.device)
    print(f"kvboost from {Path(kvboost.__file__).parent}; model {args.model or 'embedded SmolLM2-135M'} "
          f"on {next(model.parameters()).device}")
    with tempfile.TemporaryDirectory(prefix="kvboost-tier-faults-") as tmp:
        rows = latency_rows(model, tokenizer, args.requests, args.new_tokens, Path(tmp))
        print(f"\n(a) generate() per request, {args.requests} requests, each a new ~5-chunk document, "
              f"{args.new_tokens} new tokens")
        print("wall/ttft: generate() as timed by the caller (moves with the machine's load); in store: of that,\n"
              "the time the request thread spent inside the cache store (median / max over the requests)")
        print(f"{'redis':<9} {'wall s':>7} {'max s':>7} {'ttft s':>7} {'in store s':>11} {'max':>6}  redis tier")
        for kind, median, worst, ttft, store, store_max, note in rows:
            print(f"{kind:<9} {median:>7.2f} {worst:>7.2f} {ttft:>7.2f} {store:>11.3f} {store_max:>6.3f}  {note}")
        rows = index_rows(model, tokenizer, args.new_tokens, Path(tmp))
        print("\n(b) disk cache after faults")
        print(f"{'state':<16} {'files':>5}  result")
        for state, files, note in rows:
            print(f"{state:<16} {files!s:>5}  {note}")


if __name__ == "__main__":
    main()
