"""Time placing stored blocks into the contiguous workspace (PagedKV.place, the "store" row of `kvboost bench prefix
--paged`): a gather per layer (index the blocks, permute into token order, copy into the workspace: what place()
did before) against the blocks' slices concatenated straight into the workspace (what place() does; BlockPool.gather
and the table path's gather_blocks do the same on CPU), side by side in one process on
SmolLM2-135M's K/V shape (30 layers, 3 kv heads, head dim 64, fp32, 128-token blocks), blocks in shuffled order.

    python scripts/place_timing.py [--threads 1] [--tokens 1024,4096,7168]
"""
from __future__ import annotations

import argparse

import torch

from kvboost.kv.blocks import BlockLayout, BlockPool
from kvboost.kv.workspace import KVWorkspace, LayerShape
from timing_utils import best_ms  # scripts/, on the path when run as a script

LAYERS, HEADS, DIM, BLOCK = 30, 3, 64, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", default="1024,4096,7168")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for n_tokens in (int(t) for t in args.tokens.split(",")):
        g, c = time_length(n_tokens)
        print(f"{n_tokens:>6} tokens: gather {g:7.1f} ms   concatenate {c:7.1f} ms   {g / c:4.2f}x")


def time_length(n_tokens: int) -> tuple[float, float]:
    """(gather ms, concatenate ms) placing n_tokens stored in shuffled blocks; checks both place the same K/V."""
    n_blocks = -(-n_tokens // BLOCK)
    pool = BlockPool(BlockLayout(LAYERS, HEADS, DIM, BLOCK, torch.float32), n_blocks)
    pool.storage.normal_()
    order = torch.randperm(n_blocks)
    workspace = KVWorkspace([LayerShape(HEADS, DIM, DIM)] * LAYERS, torch.float32, torch.device("cpu"))
    workspace.ensure_capacity(n_tokens, keep=0)
    runs = [(b, 0, 0, min(BLOCK, n_tokens - j * BLOCK)) for j, b in enumerate(order.tolist())]

    def gather() -> None:  # index the blocks, permute into token order, copy into the workspace
        for layer in range(LAYERS):
            k, v = (cache[order].permute(1, 0, 2, 3).reshape(HEADS, n_blocks * BLOCK, DIM)
                    for cache in (pool.keys(layer), pool.values(layer)))
            workspace.write_layer(layer, [k[:, :n_tokens]], [v[:, :n_tokens]], 0)

    def concatenate() -> None:
        for layer in range(LAYERS):
            keys, values = pool.keys(layer), pool.values(layer)
            workspace.write_layer(layer, [keys[b, :, o:o + n] for b, o, _, n in runs],
                                  [values[b, :, o:o + n] for b, o, _, n in runs], 0)

    with torch.inference_mode():
        gather()
        expected = [t.clone() for t in workspace.read(0, n_tokens)[0]]
        concatenate()
        assert all(torch.equal(a, b) for a, b in zip(expected, workspace.read(0, n_tokens)[0]))
        return best_ms(gather), best_ms(concatenate)


if __name__ == "__main__":
    main()
