"""Disk and Redis behind the block pool (paged_kv=True): chunks written back as blocks reach the slow tiers, a miss
in the block cache loads them into fresh blocks, records are shared with engines that do not page, and a record
that cannot be loaded is a counted miss, never a wrong output."""
from __future__ import annotations

import pytest

from .test_engine_tiers import CHUNK, NEW, baseline_tokens, engine_on, prompt_pair, saved_model  # noqa: F401


def _stored(path, prefix, **options):
    engine = engine_on(path, **options)
    assert engine.warm(prefix).chunks_stored >= 6
    assert engine.flush()
    return engine


@pytest.mark.parametrize("writer_paged, reader_paged", [(True, True), (False, True), (True, False)])
def test_chunks_go_through_disk_between_engines(saved_model, tmp_path, tokenizer, writer_paged,  # noqa: F811
                                                reader_paged):
    cache = str(tmp_path / "cache")
    prefix, prompt = prompt_pair(tokenizer, seed=3)
    writer = _stored(saved_model, prefix, disk_cache_dir=cache, paged_kv=writer_paged)
    if writer_paged:
        stats = writer.cache_stats()
        assert stats["paged_kv"]["stored_chunks"] >= 6 and stats["tiers"]["memory"]["entries"] == 0
        assert stats["tiers"]["disk"]["entries"] >= 6
    reader = engine_on(saved_model, disk_cache_dir=cache, paged_kv=reader_paged)  # empty pool / memory
    written: list[int] = []
    if reader_paged:  # records are packed (format 2) whoever wrote them: one copy per block loaded
        pool = reader.kv.blocks.pool
        real_write_packed = pool.write_packed
        pool.write_packed = lambda block, offset, packed: (written.append(block),
                                                           real_write_packed(block, offset, packed))[1]
    result = reader.generate(prompt, NEW)
    assert result.cached_tokens >= 6 * CHUNK
    assert result.output_token_ids == baseline_tokens(reader, prompt)
    stats = reader.cache_stats()
    assert stats["tiers"]["disk"]["hits"] >= 6
    if reader_paged:
        assert stats["paged_kv"]["loaded_from_slow_tiers"] >= 6 and stats["paged_kv"]["stored_chunks"] >= 6
        assert len(written) == stats["paged_kv"]["loaded_from_slow_tiers"]  # every chunk here is one block
        again = reader.generate(prompt, NEW)  # now from the blocks: no further disk reads
        assert again.output_token_ids == result.output_token_ids
        assert reader.cache_stats()["paged_kv"]["loaded_from_slow_tiers"] == stats["paged_kv"]["loaded_from_slow_tiers"]


def test_a_partial_last_chunk_comes_from_disk_too(saved_model, tmp_path, tokenizer):  # noqa: F811
    from tests.prompts import text_with_tokens, words

    cache = str(tmp_path / "cache")
    prefix = text_with_tokens(tokenizer, 6 * CHUNK + 5, seed=8)  # whole chunks and a remainder
    prompt = prefix + " " + words(7, seed=108)
    writer = engine_on(saved_model, disk_cache_dir=cache, paged_kv=True)
    stored = writer.warm(prefix).chunks_stored
    assert writer.flush() and len(writer.encode(prefix)) % CHUNK  # the last stored chunk is partial
    # A restart: nothing in blocks. Neither reader stores its prompt (what one writes behind, the other would read).
    reader = engine_on(saved_model, disk_cache_dir=cache, paged_kv=True, write_back=False)
    unpaged = engine_on(saved_model, disk_cache_dir=cache, write_back=False)
    result = reader.generate(prompt, NEW)
    want = unpaged.generate(prompt, NEW)
    assert result.cached_tokens == want.cached_tokens > 6 * CHUNK  # the remainder too, token-granular
    assert result.output_token_ids == want.output_token_ids == baseline_tokens(reader, prompt)
    assert reader.cache_stats()["paged_kv"]["loaded_from_slow_tiers"] == stored


def test_format_1_files_load_into_blocks_layer_by_layer(saved_model, tmp_path, tokenizer):  # noqa: F811
    from pathlib import Path

    from _synth import layered_blob

    from kvboost.store.serialize import loads

    cache = tmp_path / "cache"
    prefix, prompt = prompt_pair(tokenizer, seed=6)
    writer = _stored(saved_model, prefix, disk_cache_dir=str(cache), paged_kv=True)
    files = sorted(Path(cache).glob("chunks/*/*.kvb"))
    assert len(files) >= 6
    for path in files:  # as kvboost before 0.2.0 wrote them: per-layer tensors, format 1
        path.write_bytes(layered_blob(loads(path.read_bytes()), writer.namespace))
    reader = engine_on(saved_model, disk_cache_dir=str(cache), paged_kv=True)
    pool = reader.kv.blocks.pool
    pool.write_packed = None  # the per-layer path must not need it
    result = reader.generate(prompt, NEW)
    assert result.cached_tokens >= 6 * CHUNK and result.output_token_ids == baseline_tokens(reader, prompt)
    assert reader.cache_stats()["paged_kv"]["loaded_from_slow_tiers"] >= 6


def test_a_record_that_cannot_be_loaded_is_a_counted_miss(saved_model, tmp_path, tokenizer,  # noqa: F811
                                                          monkeypatch):
    cache = str(tmp_path / "cache")
    prefix, prompt = prompt_pair(tokenizer, seed=4)
    _stored(saved_model, prefix, disk_cache_dir=cache, paged_kv=True)
    reader = engine_on(saved_model, disk_cache_dir=cache, paged_kv=True)
    slow = reader.store
    real_get = slow.get

    def damaged(key):  # a record whose tensors do not fit the blocks (another layout)
        record = real_get(key)
        if record is not None:
            record.keys = [k[:, :, :-1] for k in record.keys]
        return record

    monkeypatch.setattr(slow, "get", damaged)
    result = reader.generate(prompt, NEW)
    assert result.output_token_ids == baseline_tokens(reader, prompt)
    failures = reader.cache_stats()["paged_kv"]["load_failures"]
    assert sum(failures.values()) >= 1


@pytest.mark.redis
@pytest.mark.parametrize("bits", [16, 8])
def test_redis_behind_the_blocks(saved_model, redis_server, tokenizer, bits):  # noqa: F811
    prefix, prompt = prompt_pair(tokenizer, seed=5 + bits)
    _stored(saved_model, prefix, redis_url=redis_server.url, paged_kv=True, kv_cache_bits=bits)
    # another host: an empty pool
    reader = engine_on(saved_model, redis_url=redis_server.url, paged_kv=True, kv_cache_bits=bits)
    result = reader.generate(prompt, NEW)
    assert result.cached_tokens >= 6 * CHUNK and reader.cache_stats()["paged_kv"]["loaded_from_slow_tiers"] >= 6
    if bits == 16:  # exact; quantized K/V may change the tokens of a tiny random model
        assert result.output_token_ids == baseline_tokens(reader, prompt)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_records_are_dequantized_into_blocks(saved_model, tmp_path, tokenizer, bits):  # noqa: F811
    import torch

    prefix, prompt = prompt_pair(tokenizer, seed=7)
    full = _stored(saved_model, prefix, disk_cache_dir=str(tmp_path / "full"), paged_kv=True)
    quant = _stored(saved_model, prefix, disk_cache_dir=str(tmp_path / "quant"), paged_kv=True, kv_cache_bits=bits)
    disk_bytes = {name: e.cache_stats()["tiers"]["disk"]["bytes"] for name, e in (("full", full), ("quant", quant))}
    assert disk_bytes["quant"] < (0.4 if bits == 4 else 0.55) * disk_bytes["full"]  # quantized (fp32, small chunks)
    # Blocks in memory keep the model's dtype: a hit from them is exact, as without quantization.
    from_memory = quant.generate(prompt, NEW, return_logits=True)
    exact = full.generate(prompt, NEW, return_logits=True)
    assert from_memory.cached_tokens >= 6 * CHUNK
    assert torch.equal(from_memory.first_token_logits, exact.first_token_logits)
    # After a restart the chunks come from disk: each block holds its record's K/V dequantized, exactly.
    reader = engine_on(saved_model, disk_cache_dir=str(tmp_path / "quant"), paged_kv=True, kv_cache_bits=bits)
    got = reader.generate(prompt, NEW, return_logits=True)
    assert reader.cache_stats()["paged_kv"]["loaded_from_slow_tiers"] >= 6 and got.cached_tokens >= 6 * CHUNK
    paged = reader.kv.blocks
    checked = 0
    for chunk in paged.chunker.split(reader.encode(prefix), None):
        held = paged.cache.get(chunk.prefix_key)
        record = reader.store.get(chunk.prefix_key)
        if held is None or record is None:
            continue
        # [layers, 2, heads, tokens, dim], on the CPU beside the record (read from disk: CPU tensors)
        blocks = paged.pool.read_packed(held.blocks, held.n_tokens).cpu()
        assert all(torch.equal(blocks[i, 0], k) and torch.equal(blocks[i, 1], v)
                   for i, (k, v) in enumerate(zip(record.keys, record.values)))
        checked += 1
    assert checked >= 6
    assert not torch.equal(got.first_token_logits, exact.first_token_logits)  # the quantization error is there


def test_kv_cache_bits_with_paged_kv_needs_a_slow_tier(saved_model, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="disk_cache_dir or redis_url"):
        engine_on(saved_model, paged_kv=True, kv_cache_bits=8)
