"""Time the Python bookkeeping of stored-chunk eviction, with K/V so small that copies cost nothing:

  steady state   puts into a full cache (each evicts one chunk): the block cache and the unpaged memory tier
  long restore   a lookup that brings a whole prefix back from host memory into device blocks (every chunk over
                 the device budget, as `kvboost bench prefix --paged`'s "host" row), then its release

What a GPU request pays on top of its copies and forwards. Before the eviction order became a heap (and before a
lookup stopped enforcing the budget at each restored chunk, all of them pinned by its table), 235 puts into a
5,000-chunk cache cost 430-460 ms and a 235-chunk restore 72 ms on this 2-core CPU.

    python scripts/eviction_bookkeeping.py [--entries 5000] [--chunks 235] [--repeats 3]
"""
from __future__ import annotations

import argparse
import time

import torch

from kvboost.chunking import Chunker
from kvboost.kv.block_cache import BlockCache
from kvboost.kv.block_table import BlockTable
from kvboost.kv.blocks import BlockLayout, BlockPool
from kvboost.kv.paged_kv import build_paged_kv
from kvboost.kv.workspace import LayerShape
from kvboost.store.base import ChunkRecord
from kvboost.store.memory import MemoryStore

CHUNK = 128


def steady_block_cache(entries: int, puts: int) -> float:
    layout = BlockLayout(1, 1, 2, 4, torch.float32)
    pool = BlockPool(layout, entries + puts + 1)
    cache = BlockCache(pool, budget_bytes=entries * layout.block_nbytes)

    def put(i: int) -> None:
        (block,) = pool.allocate(1, zero=False)
        cache.put(f"k{i}", [block], (i,), start=i % 200 * 4)
        pool.decref([block])

    for i in range(entries):
        put(i)
    for i in range(0, entries, 3):
        cache.get(f"k{i}")
    t0 = time.perf_counter()
    for i in range(entries, entries + puts):
        put(i)
    return (time.perf_counter() - t0) * 1e3


def steady_memory_store(entries: int, puts: int) -> float:
    store = MemoryStore(budget_bytes=1 << 40, max_entries=entries)

    def record(i: int) -> ChunkRecord:
        kv = [torch.zeros(1, 4, 2)]
        return ChunkRecord(f"k{i}", None, f"c{i}", (i,), i % 200 * 4, kv, kv)

    for i in range(entries):
        store.put(record(i))
    t0 = time.perf_counter()
    for i in range(entries, entries + puts):
        store.put(record(i))
    return (time.perf_counter() - t0) * 1e3


def long_restore(chunks: int, repeats: int) -> list[tuple[float, float]]:
    n = chunks * CHUNK
    paged = build_paged_kv(Chunker(CHUNK, "ns"), [LayerShape(1, 8, 8)] * 2, torch.float32, torch.device("cpu"),
                           budget_bytes=1 << 30, device_budget_bytes=1, max_context=n + CHUNK)
    ids = list(range(1000, 1000 + n))
    table = BlockTable(paged.pool)
    table.reserve(n)
    for layer in range(2):
        table.write(layer, 0, torch.zeros(1, n, 8), torch.zeros(1, n, 8))
    paged.write_back(table, ids, None)
    paged.release(table)  # every chunk goes to the host (a device budget of one byte)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = paged.lookup(ids + [5], None)
        t1 = time.perf_counter()
        paged.release(plan.table)
        out.append(((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=5000)
    parser.add_argument("--chunks", type=int, default=235)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{args.chunks} puts into a full {args.entries}-chunk block cache: "
          f"{steady_block_cache(args.entries, args.chunks):.1f} ms")
    print(f"{args.chunks} puts into a full {args.entries}-entry memory tier: "
          f"{steady_memory_store(args.entries, args.chunks):.1f} ms")
    for lookup_ms, release_ms in long_restore(args.chunks, args.repeats):
        print(f"restore {args.chunks} chunks ({args.chunks * CHUNK} tokens) from host: lookup {lookup_ms:.1f} ms, "
              f"release (all back out) {release_ms:.1f} ms")


if __name__ == "__main__":
    main()
