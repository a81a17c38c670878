"""Time reading stored chunks into the block pool: format-1 records (per-layer tensors) against format-2 records
(one packed [layers, 2, heads, n, d] tensor), side by side in one process on synthetic records of SmolLM2-135M's
K/V shape (30 layers, 3 kv heads, head dim 64, fp32, 128-token chunks). Each record is verified and decoded
(`serialize.loads`), copied into fresh blocks and freed, one at a time, as `PagedKV` loads a chunk from disk or
Redis (file reads excluded). With --quantized, int8 and int4 records (kv_cache_bits 8/4: dequantized on load, layer
by layer) are timed beside them.

    python scripts/record_format_timing.py [--chunks 32] [--repeats 7] [--quantized]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "store"))
from _synth import layered_blob, make_record  # noqa: E402

from kvboost.kv.block_table import BlockTable  # noqa: E402
from kvboost.kv.blocks import BlockLayout, BlockPool  # noqa: E402
from kvboost.store.serialize import dumps, loads  # noqa: E402

LAYERS, HEADS, TOKENS, DIM = 30, 3, 128, 64


def into_blocks(pool: BlockPool, blob: bytes) -> None:
    record = loads(blob, "ns")
    table = BlockTable(pool)
    table.reserve(record.n_tokens)
    packed = record.packed_view()
    if packed is not None:  # what PagedKV._load does with each kind of record
        for j, block in enumerate(table.blocks):
            pool.write_packed(block, 0, packed[:, :, :, j * TOKENS:(j + 1) * TOKENS])
    else:
        for layer, (k, v) in enumerate(zip(record.keys, record.values)):
            table.write(layer, 0, k, v)
    table.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quantized", action="store_true", help="Also int8 and int4 records.")
    args = parser.parse_args()
    records = [make_record(i, LAYERS, HEADS, TOKENS, DIM) for i in range(args.chunks)]
    blobs = {"format 1 (per layer)": [layered_blob(r, "ns") for r in records],
             "format 2 (packed)": [dumps(r, "ns") for r in records]}
    if args.quantized:
        from kvboost.store.quant import QuantCodec

        for bits in (8, 4):
            codec = QuantCodec(bits, v_group_size=256)  # the tiers' codec (store/tiered.py)
            blobs[f"int{bits} (dequantized)"] = [dumps(r, "ns", codec) for r in records]
    pool = BlockPool(BlockLayout(LAYERS, HEADS, DIM, TOKENS, torch.float32), 4)
    times: dict[str, list[float]] = {name: [] for name in blobs}
    for _ in range(args.repeats):
        for name, group in blobs.items():  # interleaved: drift hits both alike
            t0 = time.perf_counter()
            for blob in group:
                into_blocks(pool, blob)
            times[name].append((time.perf_counter() - t0) * 1e3)
    print(f"{args.chunks} chunks x {TOKENS} tokens, {LAYERS} layers, {torch.get_num_threads()} threads: "
          "verify + decode + copy into blocks, median (min) ms")
    for name, ts in times.items():
        print(f"  {name:22s} {statistics.median(ts):7.1f} ({min(ts):.1f})")
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    two = medians["format 2 (packed)"]
    for name, m in medians.items():
        if name != "format 2 (packed)":
            print(f"  {name} / format 2: {m / two:.2f}x")


if __name__ == "__main__":
    main()
