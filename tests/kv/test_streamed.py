"""Contexts longer than device_kv_max_tokens: their K/V lives in host blocks and reaches the device one layer at a
time, with outputs identical to the all-resident run; their chunks are kept (host), found again (mapped without a
copy, restored to the device, or loaded from disk) and never freed from under a sequence reading them."""
from __future__ import annotations

import pytest
import torch

from kvboost import KVBoost
from kvboost.batch import BatchRunner
from kvboost.errors import InvalidRequestError
from kvboost.kv import layer_stream
from kvboost.kv.block_cache import BlockCache
from kvboost.kv.block_table import BlockTable
from kvboost.kv.blocks import BlockLayout, BlockPool
from kvboost.kv.host_copy import RowCopier
from kvboost.kv.host_offload import HostOffload
from kvboost.kv.layer_stream import InlineTransfers, LayerStream, Resident
from kvboost.results import GenerationMode
from kvboost.sampling import SamplingParams

from ..prompts import text_with_tokens, words
from ..tiny_models import TINY_ARCHS, make_tiny_model

CHUNK = 16
ON_DEVICE = 40  # positions a sequence may hold on the device: every prompt below is longer


@pytest.fixture(params=["concatenated", "staged"])
def path(request, monkeypatch) -> str:
    """Run a test both ways a device reads host blocks: the CPU's concatenation and CUDA's staged copies (block
    layout, a layer ahead, pinned outbox), the latter with copies that complete as issued (InlineTransfers)."""
    if request.param == "staged":
        monkeypatch.setattr(layer_stream, "transfers_for", lambda device, host: InlineTransfers())
    return request.param


def _streaming(model, tokenizer, **kw) -> KVBoost:
    return KVBoost(model, tokenizer, chunk_size=CHUNK, paged_kv=True, device_kv_budget_bytes=1 << 20,
                   device_kv_max_tokens=ON_DEVICE, **kw)


def _streamed(engine: KVBoost) -> dict:
    return engine.cache_stats()["paged_kv"]["streamed"]


def _same(got, want) -> None:
    """Bit for bit: `want` comes from a resident engine that ran the same requests (so reused the same K/V; a
    full prefill of the whole prompt rounds differently from a suffix over reused K/V, in any engine)."""
    assert got.output_token_ids == want.output_token_ids
    assert got.cached_tokens == want.cached_tokens
    if want.first_token_logits is None:
        return
    if want.first_token_logits.device.type == "cpu":
        assert torch.equal(got.first_token_logits, want.first_token_logits)
    else:  # the resident engine's captured steps and the streamed eager forward may round differently on a GPU
        assert torch.allclose(got.first_token_logits, want.first_token_logits, atol=1e-5)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_streamed_outputs_equal_the_resident_run(tokenizer, device, arch, path):
    model = make_tiny_model(arch, tokenizer)
    resident, streaming = KVBoost(model, tokenizer, chunk_size=CHUNK), _streaming(model, tokenizer)
    prompt = text_with_tokens(tokenizer, 5 * CHUNK + 3, seed=1)
    for mode in ("baseline", "chunk_kv_reuse"):
        resident.forget_workspace()  # a streamed sequence has no workspace to find the last prompt in
        _same(streaming.generate(prompt, max_new_tokens=8, mode=mode, return_logits=True),
              resident.generate(prompt, max_new_tokens=8, mode=mode, return_logits=True))
    stats = _streamed(streaming)
    assert stats["requests"] == 2 and stats["forwards"] == 2 * 8  # a prefill and 7 decode steps each
    assert stats["bytes_to_device"] > 0 and stats["bytes_to_host"] > 0


def test_a_streamed_prefix_is_mapped_again_without_a_copy(tokenizer, device, path):
    model = make_tiny_model("llama", tokenizer)
    resident, streaming = KVBoost(model, tokenizer, chunk_size=CHUNK), _streaming(model, tokenizer)
    document = text_with_tokens(tokenizer, 6 * CHUNK, seed=2)
    for engine in (streaming, resident):
        engine.generate(document + " " + words(6, seed=3), max_new_tokens=4)
        engine.forget_workspace()
    host = streaming.cache_stats()["paged_kv"]["host"]
    assert host["adopted"] >= 6 and host["offloaded"] == 0  # kept in the sequence's own blocks: nothing moved
    follow_up = document + " " + words(9, seed=4)
    got = streaming.generate(follow_up, max_new_tokens=8, return_logits=True)
    _same(got, resident.generate(follow_up, max_new_tokens=8, return_logits=True))
    assert got.cached_tokens >= 6 * CHUNK
    stats = _streamed(streaming)
    assert stats["mapped_chunks"] >= 6 and stats["copied_chunks"] == 0


def test_streamed_and_resident_requests_share_chunks_both_ways(tokenizer, device, path):
    model = make_tiny_model("qwen2", tokenizer)
    resident, streaming = KVBoost(model, tokenizer, chunk_size=CHUNK), _streaming(model, tokenizer)
    short = text_with_tokens(tokenizer, CHUNK + 4, seed=5)
    long = short + " " + text_with_tokens(tokenizer, 4 * CHUNK, seed=6)
    ids = streaming.encode(long)[:2 * CHUNK + 2]  # its second chunk whole: only the streamed request stored that
    for engine in (resident, streaming):
        engine.warm(short)  # ~20 positions: held on the device
    got = streaming.generate(long, max_new_tokens=6, return_logits=True)  # the device chunks are copied to host
    _same(got, resident.generate(long, max_new_tokens=6, return_logits=True))
    assert _streamed(streaming)["copied_chunks"] >= 1 and got.cached_tokens > CHUNK
    # A request short enough for the device reads the streamed request's chunks: restored from the host.
    for engine in (resident, streaming):
        engine.forget_workspace()
    got = streaming.generate(input_ids=ids, max_new_tokens=4, return_logits=True)
    _same(got, resident.generate(input_ids=ids, max_new_tokens=4, return_logits=True))
    assert got.cached_tokens > 2 * CHUNK and streaming.cache_stats()["paged_kv"]["host"]["restored"] >= 1


def test_warming_a_long_text_keeps_it_in_host_blocks(tokenizer, device, path):
    model = make_tiny_model("llama", tokenizer)
    resident, streaming = KVBoost(model, tokenizer, chunk_size=CHUNK), _streaming(model, tokenizer)
    document = text_with_tokens(tokenizer, 5 * CHUNK, seed=14)
    for engine in (resident, streaming):
        assert engine.warm(document).chunks_stored >= 5
        engine.forget_workspace()
    assert streaming.cache_stats()["paged_kv"]["stored_chunks"] == 0  # nothing of it went to the device pool
    assert streaming.cache_stats()["paged_kv"]["host"]["adopted"] >= 5
    assert streaming.warm(document).chunks_stored == 0  # all there already
    prompt = document + " " + words(7, seed=15)
    got = streaming.generate(prompt, max_new_tokens=6, return_logits=True)
    _same(got, resident.generate(prompt, max_new_tokens=6, return_logits=True))
    assert got.cached_tokens >= 5 * CHUNK and _streamed(streaming)["mapped_chunks"] >= 5


def test_streamed_speculation_rolls_back_in_host_blocks(tokenizer, device, path):
    model = make_tiny_model("llama", tokenizer)
    resident, streaming = KVBoost(model, tokenizer, chunk_size=CHUNK), _streaming(model, tokenizer)
    prompt = " ".join([words(12, seed=7)] * 5)  # repetitive: prompt lookup drafts, some rejected
    want = resident.generate(prompt, max_new_tokens=24, mode="baseline")
    got = streaming.generate(prompt, max_new_tokens=24, speculative="prompt_lookup")
    assert got.output_token_ids == want.output_token_ids
    assert got.speculative == "prompt_lookup" and got.draft_tokens > 0


def test_a_draft_model_speculates_over_a_streamed_target(tokenizer, device, path):
    model = make_tiny_model("llama", tokenizer)
    resident = KVBoost(model, tokenizer, chunk_size=CHUNK)
    streaming = _streaming(model, tokenizer, draft_model=make_tiny_model("llama", tokenizer))  # the same weights
    prompt = text_with_tokens(tokenizer, 4 * CHUNK, seed=17)
    got = streaming.generate(prompt, max_new_tokens=16, speculative="draft", num_speculative_tokens=4)
    assert got.output_token_ids == resident.generate(prompt, max_new_tokens=16, mode="baseline").output_token_ids
    assert got.draft_tokens > 0 and got.accepted_tokens == got.draft_tokens  # every draft verified, all kept
    assert _streamed(streaming)["requests"] == 1


def test_a_forward_that_fails_midway_leaves_no_blocks_behind(tokenizer, device, path, monkeypatch):
    model = make_tiny_model("llama", tokenizer)
    resident, streaming = KVBoost(model, tokenizer, chunk_size=CHUNK), _streaming(model, tokenizer)
    host_pool = streaming.kv.streamed.pool
    prompt = text_with_tokens(tokenizer, 4 * CHUNK, seed=8)
    take = LayerStream.take

    def failing(self, layer, q):
        if layer == 1:
            raise RuntimeError("copy failed")
        return take(self, layer, q)

    device_pool = streaming.kv.blocks.pool
    device_used = device_pool.num_used
    monkeypatch.setattr(LayerStream, "take", failing)
    with pytest.raises(RuntimeError, match="copy failed"):
        streaming.generate(prompt, max_new_tokens=4)
    monkeypatch.setattr(LayerStream, "take", take)
    import gc

    gc.collect()  # the failed request's plan (and its table's holds) go with it
    assert host_pool.num_used == 0 and device_pool.num_used == device_used  # its device blocks too
    got = streaming.generate(prompt, max_new_tokens=4)
    assert got.output_token_ids == resident.generate(prompt, max_new_tokens=4, mode="baseline").output_token_ids


def test_batches_run_streamed_rows_apart_and_the_runner_refuses_them(tokenizer, device):
    model = make_tiny_model("llama", tokenizer)
    resident, streaming = KVBoost(model, tokenizer, chunk_size=CHUNK), _streaming(model, tokenizer)
    prompts = [words(5, seed=9), text_with_tokens(tokenizer, 4 * CHUNK, seed=10)]  # one short, one streamed
    got = streaming.generate_batch(prompts, max_new_tokens=5)
    want = [resident.generate(p, max_new_tokens=5, mode="baseline") for p in prompts]
    assert [g.output_token_ids for g in got] == [w.output_token_ids for w in want]
    assert _streamed(streaming)["requests"] == 1
    runner = BatchRunner(streaming, max_batch_size=2)
    with pytest.raises(InvalidRequestError, match="device_kv_max_tokens"):
        runner.add(streaming.encode(prompts[1]), SamplingParams(max_new_tokens=5))


def test_streamed_chunks_are_written_behind_and_loaded_from_disk(tokenizer, device, path, tmp_path):
    model = make_tiny_model("llama", tokenizer)
    resident = KVBoost(model, tokenizer, chunk_size=CHUNK)
    prompt = text_with_tokens(tokenizer, 5 * CHUNK, seed=11)
    first = _streaming(model, tokenizer, disk_cache_dir=str(tmp_path))
    for engine in (first, resident):
        engine.generate(prompt, max_new_tokens=3)
        engine.forget_workspace()
    assert first.flush()
    second = _streaming(model, tokenizer, disk_cache_dir=str(tmp_path))  # a restart: nothing in memory
    got = second.generate(prompt + " " + words(4, seed=12), max_new_tokens=6, return_logits=True)
    want = resident.generate(prompt + " " + words(4, seed=12), max_new_tokens=6, return_logits=True)
    # Whole chunks and the remainder's partial chunk come from disk (token-granular, as from memory): the tokens
    # the resident engine reuses, the same outputs and logits.
    assert got.cached_tokens == want.cached_tokens > 5 * CHUNK
    assert got.output_token_ids == want.output_token_ids
    assert torch.allclose(got.first_token_logits, want.first_token_logits, atol=1e-5)
    assert _streamed(second)["loaded_chunks"] >= 6


def test_content_reuse_on_a_streamed_context_says_why_it_was_not_used(tokenizer, device):
    model = make_tiny_model("llama", tokenizer)
    streaming = _streaming(model, tokenizer)
    ids = streaming.encode(text_with_tokens(tokenizer, 4 * CHUNK, seed=13))
    assert streaming.generate(input_ids=ids, max_new_tokens=2, content_reuse=True).output_token_ids
    plan = streaming.kv.lookup_streamed(ids, None, GenerationMode.CHUNK_KV_REUSE, approximate=True)
    assert "device_kv_max_tokens" in (plan.content_fallback or "")


def test_device_kv_max_tokens_is_validated(tokenizer, device):
    model = make_tiny_model("llama", tokenizer)
    with pytest.raises(ValueError, match="paged_kv"):
        KVBoost(model, tokenizer, device_kv_max_tokens=64)
    if device.type != "cuda":
        with pytest.raises(ValueError, match="host offload"):  # no host tier elsewhere than CUDA unless asked
            KVBoost(model, tokenizer, paged_kv=True, device_kv_max_tokens=64)
    else:  # CUDA offloads to the host by default (device_kv_budget), so the limit needs nothing more
        engine = KVBoost(model, tokenizer, paged_kv=True, device_kv_max_tokens=64, memory_budget_bytes=16 << 20)
        assert engine.kv.blocks.host is not None and engine.kv.streamed.max_device_tokens == 64
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="device_kv_max_tokens"):
            KVBoost(model, tokenizer, paged_kv=True, device_kv_budget_bytes=1 << 20, device_kv_max_tokens=bad)


# ---- the pieces ------------------------------------------------------------------------------------------
LAYOUT = BlockLayout(2, 2, 4, 4, torch.float32)


def _written(pool: BlockPool) -> tuple[BlockTable, torch.Tensor, torch.Tensor]:
    """A 10-position table over `pool` holding random K and V [layers, kv_heads, 10, d]."""
    table = BlockTable(pool)
    table.reserve(10)
    k = torch.randn(2, LAYOUT.kv_heads, 10, LAYOUT.head_dim)
    v = torch.randn_like(k)
    for layer in range(2):
        table.write(layer, 0, k[layer], v[layer])
    return table, k, v


def test_layer_stream_hands_each_layer_the_tables_positions():
    table, k, v = _written(BlockPool(LAYOUT, 6))
    stream = LayerStream(table, 7, torch.device("cpu"))
    for layer in range(2):
        keys, values = stream.take(layer, 3)
        assert keys.shape == (1, LAYOUT.kv_heads, 10, LAYOUT.head_dim)
        assert torch.equal(keys[0, :, :7], k[layer, :, :7]) and torch.equal(values[0, :, :7], v[layer, :, :7])
    assert stream.bytes_to_device == 2 * 2 * 7 * LAYOUT.kv_heads * LAYOUT.head_dim * 4


def test_positions_the_device_keeps_are_read_there_and_filled_from_the_stream():
    device_pool = BlockPool(LAYOUT, 4)
    table, k, v = _written(BlockPool(LAYOUT, 6))
    resident_table = BlockTable(device_pool)
    resident_table.reserve(6)
    resident = Resident(resident_table)
    per_position = 2 * LAYOUT.kv_heads * LAYOUT.head_dim * 4  # K and V of one layer, fp32
    first = LayerStream(table, 8, torch.device("cpu"), resident=resident)  # nothing on the device yet
    for layer in range(2):
        keys, values = first.take(layer, 2)
        assert torch.equal(keys[0, :, :8], k[layer, :, :8]) and torch.equal(values[0, :, :8], v[layer, :, :8])
    assert first.bytes_to_device == 2 * 8 * per_position
    resident.filled = 6  # what the forward's end records: the first 6 positions are kept
    for layer in range(2):  # ... and really are in the device blocks
        kept_k, kept_v = device_pool.gather(layer, resident_table.ids()[None])
        assert torch.equal(kept_k[0, :, :6], k[layer, :, :6]) and torch.equal(kept_v[0, :, :6], v[layer, :, :6])
    second = LayerStream(table, 9, torch.device("cpu"), resident=resident)
    for layer in range(2):
        keys, values = second.take(layer, 1)
        assert torch.equal(keys[0, :, :9], k[layer, :, :9]) and torch.equal(values[0, :, :9], v[layer, :, :9])
    assert second.bytes_to_device == 2 * 3 * per_position  # only positions 6, 7, 8 crossed


def test_a_streamed_decode_step_moves_only_what_the_device_does_not_keep(tokenizer, device):
    model = make_tiny_model("llama", tokenizer)
    streaming = _streaming(model, tokenizer)
    ids = streaming.encode(text_with_tokens(tokenizer, 6 * CHUNK, seed=16))
    moved = []
    for n in (1, 5):
        before = _streamed(streaming)["bytes_to_device"]
        streaming.generate(input_ids=ids, max_new_tokens=n, mode="baseline")
        moved.append(_streamed(streaming)["bytes_to_device"] - before)
    block = streaming.cache_stats()["paged_kv"]
    per_position = block["block_bytes"] // block["block_size"]
    # The prefill moves nothing (baseline: no stored prefix); decode step i (of 4) runs position len(ids) + i over
    # the positions before it, of which all but the first 40 (kept on the device) cross from the host: exactly
    # those on a CPU (a concatenation), whole blocks on CUDA (one copy per block run: from the block holding
    # position 40 to the block holding the step's last earlier position).
    assert moved[0] == 0
    if device.type == "cuda":
        crossing = [(-(-(len(ids) + i) // CHUNK) - ON_DEVICE // CHUNK) * CHUNK for i in range(4)]
    else:
        crossing = [len(ids) + i - ON_DEVICE for i in range(4)]
    assert moved[1] == sum(crossing) * per_position
    assert streaming.kv.blocks.pool.num_used == 0  # the device blocks went back with each request


def test_staged_copies_cut_blocks_at_the_positions_the_device_keeps(monkeypatch):
    monkeypatch.setattr(layer_stream, "transfers_for", lambda device, host: InlineTransfers())
    device_pool = BlockPool(LAYOUT, 4)
    table, k, v = _written(BlockPool(LAYOUT, 6))
    resident_table = BlockTable(device_pool)
    resident_table.reserve(6)  # 6 positions kept: the second block is staged from its third position on
    resident = Resident(resident_table)
    for n, q, filled in ((8, 2, 0), (9, 1, 6)):
        resident.filled = filled
        stream = LayerStream(table, n, torch.device("cpu"), resident=resident)
        assert stream.staged
        for layer in range(2):
            keys, values = stream.take(layer, q)
            assert keys.shape == (1, LAYOUT.kv_heads, n + q, LAYOUT.head_dim)
            assert torch.equal(keys[0, :, :n], k[layer, :, :n]) and torch.equal(values[0, :, :n], v[layer, :, :n])
        assert not stream.pending
        blocks = LAYOUT.blocks_for(n) - filled // LAYOUT.block_size  # whole blocks cross, from the first not kept
        assert stream.bytes_to_device == 2 * blocks * LAYOUT.block_nbytes // LAYOUT.layers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream prefetch path needs a CUDA device")
def test_layer_stream_prefetches_from_pinned_blocks_on_cuda():
    table, k, v = _written(BlockPool(LAYOUT, 6, "cpu", pin_memory=True))
    stream = LayerStream(table, 7, torch.device("cuda"))
    assert stream.staged
    for layer in range(2):
        keys, values = stream.take(layer, 3)
        assert keys.device.type == "cuda" and keys.shape == (1, LAYOUT.kv_heads, 10, LAYOUT.head_dim)
        assert torch.equal(keys[0, :, :7].cpu(), k[layer, :, :7]) and torch.equal(values[0, :, :7].cpu(),
                                                                                  v[layer, :, :7])
    assert not stream.pending


def test_a_host_chunk_a_streamed_table_reads_is_never_evicted():
    device, host = BlockPool(LAYOUT, 4), BlockPool(LAYOUT, 3)
    offload = HostOffload(device, host, budget_blocks=2)
    BlockCache(device, spill=offload.stash)
    table = BlockTable(host)
    table.reserve(8)  # two blocks a streamed sequence wrote
    assert offload.adopt("a", table.blocks[:1], (1, 2, 3, 4), 0) and offload.adopt("b", table.blocks[1:], (5,) * 4, 4)
    table.release()
    reader = BlockTable(host)
    hit = offload.acquire("a")
    reader.map_shared(hit.blocks, 4, held=True)
    table = BlockTable(host)
    table.reserve(8)  # the pool is short: only "b" (unpinned) may go
    assert offload.contains("a") and not offload.contains("b")
    assert not offload.adopt("c", table.blocks, (7,) * 8, 0)  # over budget with "a" pinned: refused, counted
    assert offload.stats().failures == {"host_full": 1}
    reader.release()
    table.release()
    assert host.num_used == 1  # "a", held by the host tier alone


def test_the_cuda_default_streams_only_contexts_the_device_could_not_hold(monkeypatch):
    from kvboost.kv.streamed_kv import device_max_tokens
    from kvboost.kv.workspace import LayerShape

    shapes = [LayerShape(2, 64, 64)] * 4  # 4 layers x K and V x 2 heads x 64 x 4 bytes = 4 KiB per token
    per_token = 4 * 2 * 2 * 64 * 4
    cuda, free = torch.device("cuda"), 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    budget = int(free * 0.3)
    # 32k-token contexts: two of them (256 MiB) beside the budget fit in 60% of free memory: nothing streams.
    assert device_max_tokens(None, cuda, budget, shapes, torch.float32, 32768) is None
    # 128k-token contexts would not: the device keeps what 15% of free memory holds of a sequence.
    assert device_max_tokens(None, cuda, budget, shapes, torch.float32, 131072) == int(0.15 * free) // per_token
    assert device_max_tokens(500, cuda, budget, shapes, torch.float32, 131072) == 500  # configured wins
    assert device_max_tokens(None, torch.device("cpu"), budget, shapes, torch.float32, 131072) is None
    assert device_max_tokens(None, cuda, None, shapes, torch.float32, 131072) is None  # no host offload


def test_staged_copies_go_one_per_run_of_consecutive_host_blocks(monkeypatch):
    """Host blocks 0, 2, 3 (another table took block 1): two runs, so two row copies per layer, and the values
    land in token order as from per-block copies."""
    monkeypatch.setattr(layer_stream, "transfers_for", lambda device, host: InlineTransfers())
    pool, bs = BlockPool(LAYOUT, 6), LAYOUT.block_size
    table, other = BlockTable(pool), BlockTable(pool)
    table.reserve(bs)
    other.reserve(bs)
    table.reserve(2 * bs)  # reserve adds positions: two more blocks
    assert table.blocks == [0, 2, 3]
    k = torch.randn(2, LAYOUT.kv_heads, 3 * bs, LAYOUT.head_dim)
    v = torch.randn_like(k)
    for layer in range(2):
        table.write(layer, 0, k[layer], v[layer])
    calls: list[int] = []

    class Recording(RowCopier):
        def copy_rows(self, dst, src):
            calls.append(src.shape[0])
            super().copy_rows(dst, src)

    stream = LayerStream(table, 3 * bs, torch.device("cpu"))
    stream.copier = Recording.per_row()
    for layer in range(2):
        keys, values = stream.take(layer, 1)
        assert torch.equal(keys[0, :, :3 * bs], k[layer]) and torch.equal(values[0, :, :3 * bs], v[layer])
    assert calls == [1, 2, 1, 2]  # per layer: the run of block 0, then the run of blocks 2 and 3
