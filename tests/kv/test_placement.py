"""Placing many stored chunks at once (KVWorkspace.write_layer, KVCacheManager.place, QuantRun) is a pure copy:
the workspace ends up bit-identical to placing (and dequantizing) the chunks one by one."""
from __future__ import annotations

import pytest
import torch

from kvboost import GenerationMode, KVBoost
from kvboost.kv import manager
from kvboost.kv.manager import Plan
from kvboost.kv.workspace import KVWorkspace, LayerShape
from kvboost.store import quant
from kvboost.store.base import ChunkRecord
from kvboost.store.quant import LazyQuantRecord, QuantCodec, QuantRun, decode_record

from ..prompts import words
from ..tiny_models import make_tiny_model

SHAPES = [LayerShape(kv_heads=2, head_dim_k=8, head_dim_v=8)] * 3
CHUNK = 16


def _chunks(lengths: list[int], device: torch.device, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Per-chunk [layers] lists of K and V, [kv_heads, n, d] each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        keys = [torch.randn(2, n, 8, generator=g).to(device=device, dtype=dtype) for _ in SHAPES]
        values = [torch.randn(2, n, 8, generator=g).to(device=device, dtype=dtype) for _ in SHAPES]
        out.append((keys, values))
    return out


def _buffers(ws: KVWorkspace) -> list[torch.Tensor]:
    return [t for i in range(len(ws.shapes)) for t in ws.buffers(i)]


def _same(a: KVWorkspace, b: KVWorkspace) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_buffers(a), _buffers(b)))


@pytest.mark.parametrize("row", [None, 1])
@pytest.mark.parametrize("lengths", [[16, 16, 5], [16] * 9 + [7], [3, 16, 16, 16, 16, 16, 11]])
@pytest.mark.parametrize("source", ["device", "cpu", "float64"])
def test_write_layer_equals_one_write_per_chunk(device, row, lengths, source):
    """Few pieces (copied one by one), many (one cat into the buffer), from a CPU tier or another dtype."""
    src_device = torch.device("cpu") if source == "cpu" else device
    dtype = torch.float64 if source == "float64" else torch.float32
    chunks = _chunks(lengths, src_device, dtype)
    batched, reference = (KVWorkspace(SHAPES, torch.float32, device, batch_size=2) for _ in range(2))
    for ws in (batched, reference):
        ws.ensure_capacity(sum(lengths) + 10, keep=0)
    start = 3
    for i in range(len(SHAPES)):
        batched.write_layer(i, [k[i] for k, _ in chunks], [v[i] for _, v in chunks], start, row=row)
    pos = start
    for keys, values in chunks:
        reference.write(keys, values, pos, row=row)
        pos += keys[0].shape[1]
    assert _same(batched, reference)
    untouched = 0 if row == 1 else None
    if untouched is not None:  # the other row stays zero
        assert not batched.read(0, pos, row=untouched)[0][0].any()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("cap", [None, 1 << 16])  # the CPU's cache-sized batches, and a GPU's whole runs
def test_quant_run_is_bit_identical_to_decoding_each_chunk(device, bits, cap, monkeypatch):
    if cap is not None:
        monkeypatch.setattr(quant, "_batch_tokens", lambda t: cap)
    codec = QuantCodec(bits, group_size=8, v_group_size=12)  # K groups shorter than chunks; V groups ragged
    # Even and odd lengths (an odd int4 K row straddles a byte: decoded alone), a raw (non-finite) layer.
    lengths = [16, 16, 9, 16, 3, 16, 16, 24, 16, 1, 16, 16, 16]
    payloads = []
    for c, (keys, values) in enumerate(_chunks(lengths, device, torch.bfloat16, seed=bits)):
        if c == 5:
            keys[1][0, 0, 0] = float("inf")
        record = ChunkRecord(f"k{c}", None, f"c{c}", tuple(range(lengths[c])), 0, keys, values)
        payloads.append(codec.encode(record))
    run = QuantRun(payloads)
    for i in range(len(SHAPES)):
        keys, values = run.layer(i)
        want_k = torch.cat([decode_record(p)[0][i] for p in payloads], dim=1)
        want_v = torch.cat([decode_record(p)[1][i] for p in payloads], dim=1)
        assert torch.equal(torch.cat(keys, dim=1), want_k) and torch.equal(torch.cat(values, dim=1), want_v)
        if cap is not None:  # whole runs: broken only by chunks decoded alone (odd int4 rows, raw layers)
            assert len(keys) <= (2 if bits == 8 and i != 1 else 8)


def test_lazy_record_decodes_only_when_asked(device):
    keys, values = _chunks([16], device)[0]
    payload = QuantCodec(8).encode(ChunkRecord("k", None, "c", tuple(range(16)), 32, keys, values))
    record = QuantCodec(8).decode(payload)
    assert isinstance(record, LazyQuantRecord) and record._decoded is None
    assert record.token_ids == tuple(range(16)) and record.start == 32 and record.n_tokens == 16
    assert record.nbytes == sum(t.numel() * t.element_size() for t in keys + values) and record._decoded is None
    assert all(torch.equal(a, b) for a, b in zip(record.keys, decode_record(payload)[0]))


def _reference_place(plan: Plan, ws: KVWorkspace, row: int | None) -> None:
    """Placement as it was: one write per segment, each stored chunk dequantized on its own."""
    for seg in plan.segments:
        start = max(seg.start, plan.resident)
        n = min(seg.end, plan.reuse_len) - start
        if n > 0:
            ws.write([k[:, start - seg.start:] for k in seg.record.keys],
                     [v[:, start - seg.start:] for v in seg.record.values], start, n, row=row)


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("row", [None, 1])
@pytest.mark.parametrize("threaded", [False, True])  # long CPU runs place their layers on torch's threads
def test_place_equals_per_chunk_placement(tokenizer, bits, row, threaded, monkeypatch):
    monkeypatch.setattr(manager, "_POOL_BYTES", 0 if threaded else 1 << 62)
    pools = []
    monkeypatch.setattr(manager, "_copy_pool", lambda n, real=manager._copy_pool: pools.append(1) or real(n))
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))  # the pool serves only more than one thread
    try:
        _check_place(tokenizer, bits, row)
    finally:
        torch.set_num_threads(threads)
    assert bool(pools) == threaded


def _check_place(tokenizer, bits, row):
    engine = KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=CHUNK, kv_cache_bits=bits)
    ids = engine.encode(words(200, seed=7))
    assert len(ids) >= 170
    stored = ids[:150]
    engine.warm_ids(stored)  # 9 whole chunks and a 6-token remainder
    prompts = {
        "whole": stored + ids[150:170],
        "stops mid-remainder": stored[:147] + [t + 1 for t in ids[147:170]],  # 3 of the remainder's 6 tokens
    }
    for name, prompt in prompts.items():
        # resident: the first piece starts mid-chunk; the last one may stop short of its record's end
        plan = engine.kv.lookup(prompt, None, GenerationMode.CHUNK_KV_REUSE, resident=prompt[:37])
        assert plan.resident == 37 and len(plan.segments) > 5, name
        assert plan.reuse_len == (150 if name == "whole" else 147)
        batched, reference = (KVWorkspace(engine.workspace.shapes, engine.kv_dtype, engine.device, batch_size=2)
                              for _ in range(2))
        for ws in (batched, reference):
            ws.ensure_capacity(len(prompt), keep=0)
        engine.kv.place(plan, batched, prompt, row=row)
        _reference_place(plan, reference, row)
        assert _same(batched, reference), name
        assert batched.read(37, plan.reuse_len, row=1)[0][0].any()  # something was placed
