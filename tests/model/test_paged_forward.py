"""Forwards over a block table (no workspace): prefill and decode match the model's own forward; an exact hit is
attended where it is stored, and the stored blocks never change under the sequence that maps them."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvboost.chunking import Chunker
from kvboost.kv.block_cache import BlockCache
from kvboost.kv.block_table import BlockTable
from kvboost.kv.blocks import BlockLayout, BlockPool
from kvboost.kv.paged_kv import PagedKV
from kvboost.model.cache_arg import cache_kwargs
from kvboost.model.forward import probe_layer_shapes
from kvboost.model.paged import paged_forward

from ..prompts import words
from ..tiny_models import make_tiny_model

CHUNK, BS = 16, 8
TOL = dict(atol=1e-5, rtol=1e-5)


def _pool(model, num_blocks: int = 32) -> BlockPool:
    shapes, dtype = probe_layer_shapes(model)
    return BlockPool(BlockLayout.for_layers(shapes, BS, dtype), num_blocks, next(model.parameters()).device)


def _reference(model, ids: list[int], steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """The model's own forward (DynamicCache): logits of the prompt's last position and of each greedy step."""
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([ids], device=device), **cache_kwargs(cache), use_cache=True)
    logits, fed = [out.logits[0, -1].float()], []
    for _ in range(steps):
        fed.append(int(logits[-1].argmax()))
        out = model(input_ids=torch.tensor([[fed[-1]]], device=device), **cache_kwargs(cache), use_cache=True)
        logits.append(out.logits[0, -1].float())
    return logits, fed


def _paged(model, ids: list[int], table: BlockTable, steps: int, backend: str | None = None):
    logits, fed = [paged_forward(model, ids, table, backend=backend)[0, -1]], []
    for _ in range(steps):
        fed.append(int(logits[-1].argmax()))
        logits.append(paged_forward(model, [fed[-1]], table, backend=backend)[0, -1])
    return logits, fed


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_paged_forward_matches_the_model(tokenizer, device, arch):
    model = make_tiny_model(arch, tokenizer, device=device)
    ids = tokenizer(words(30, seed=1))["input_ids"]
    table = BlockTable(_pool(model))
    with torch.inference_mode():
        got, got_fed = _paged(model, ids, table, steps=4, backend="sdpa")
        want, want_fed = _reference(model, ids, steps=4)
    assert got_fed == want_fed and table.length == len(ids) + 4
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


def test_paged_forward_through_the_triton_kernel(tokenizer, kernel_device):
    model = make_tiny_model("llama", tokenizer, device=kernel_device)
    ids = tokenizer(words(12, seed=2))["input_ids"]
    table = BlockTable(_pool(model))
    with torch.inference_mode():
        got, got_fed = _paged(model, ids, table, steps=2, backend="triton")
        want, want_fed = _reference(model, ids, steps=2)
    assert got_fed == want_fed
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


def test_exact_hit_is_attended_in_place(tokenizer, device):
    model = make_tiny_model("qwen2", tokenizer, device=device)
    pool = _pool(model)
    kv = PagedKV(Chunker(CHUNK, "ns"), pool, BlockCache(pool))
    a = tokenizer(words(30, seed=3))["input_ids"]
    b = a[:2 * CHUNK + 3] + tokenizer(words(6, seed=4))["input_ids"]  # 2 whole chunks + 3 tokens of the third
    with torch.inference_mode():
        writer = BlockTable(pool)
        paged_forward(model, a, writer, backend="sdpa")
        kv.write_back(writer, a, None)
        writer.release()
        plan = kv.lookup(b, None)
        assert plan.reuse_len == 2 * CHUNK + 3 and plan.chunks == 3
        mapped = list(plan.table.blocks)
        stored = pool.storage[mapped].clone()
        logits = paged_forward(model, b[plan.reuse_len:], plan.table, backend="sdpa")[0, -1]
        want, _ = _reference(model, b, steps=0)
    torch.testing.assert_close(logits, want[0], **TOL)
    assert plan.table.cow_copies == 1  # the third chunk's partly used block, shared with the cache
    assert torch.equal(pool.storage[mapped], stored)  # what the cache holds did not change
    plan.table.release()


def test_paged_forward_refuses_sliding_windows_and_cuts_back(tokenizer, device):
    model = make_tiny_model("gemma3", tokenizer, device=device)
    table = BlockTable(_pool(model))
    with pytest.raises(NotImplementedError), torch.inference_mode():
        paged_forward(model, tokenizer(words(10, seed=5))["input_ids"], table, backend="sdpa")
    assert table.length == 0 and not table.blocks
