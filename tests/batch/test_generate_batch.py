"""Batched and continuous generation: same tokens as one-at-a-time generation, shared prefix loaded once."""
from __future__ import annotations

import pytest
import torch

from kvboost import InvalidRequestError, KVBoost
from kvboost.batch import find_common_chunk_prefix, group_by_prefix
from kvboost.compat import has_sliding_layers
from kvboost.sampling import SamplingParams
from kvboost.scheduler import Scheduler

from ..hf_reference import hf_greedy
from ..prompts import text_with_tokens, words
from ..tiny_models import make_tiny_model

CHUNK = 16


def test_find_common_chunk_prefix():
    assert find_common_chunk_prefix([[1, 2, 3, 4, 5], [1, 2, 3, 4, 9]], 2) == 4
    assert find_common_chunk_prefix([[1, 2, 3, 4, 5], [1, 2, 3, 9]], 2) == 2
    assert find_common_chunk_prefix([[1, 2], [3, 4]], 2) == 0
    assert find_common_chunk_prefix([], 2) == 0


def test_group_by_prefix():
    ids = [[1, 2, 3, 4, 7], [1, 2, 3, 4, 8], [5, 6, 7, 8]]
    groups = group_by_prefix(["a", "b", "c"], ids, chunk_size=2, n_prefix_chunks=2)
    assert sorted(groups.values()) == [[0, 1], [2]]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gemma3"])
def test_generate_batch_matches_single_generation(arch, tokenizer):
    model = make_tiny_model(arch, tokenizer)
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    system = text_with_tokens(tokenizer, 3 * CHUNK + 5, seed=1)
    prompts = [system + " " + words(n, seed=n) for n in (3, 9, 17, 5)]
    results = engine.generate_batch(prompts, max_new_tokens=10)
    for prompt, result in zip(prompts, results):
        ids = engine.encode(prompt)
        assert result.output_token_ids == hf_greedy(model, tokenizer, ids, 10)
    # The shared system prompt was computed once and reused by every row.
    assert all(r.cached_tokens >= 3 * CHUNK for r in results)
    assert has_sliding_layers(model) == (arch == "gemma3")


def test_rows_join_and_leave_mid_flight(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    runner = Scheduler(engine, max_batch_size=4)
    prompts = [text_with_tokens(tokenizer, 20 + 7 * i, seed=20 + i) for i in range(5)]
    budgets = [3, 12, 6, 9, 4]
    handles = [runner.add(engine.encode(prompts[0]), SamplingParams(max_new_tokens=budgets[0]), prompts[0])]
    runner.step()
    handles.append(runner.add(engine.encode(prompts[1]), SamplingParams(max_new_tokens=budgets[1]), prompts[1]))
    runner.step()
    runner.step()
    for i in (2, 3, 4):  # the fifth waits for a free slot
        handles.append(runner.add(engine.encode(prompts[i]), SamplingParams(max_new_tokens=budgets[i]), prompts[i]))
    cancelled = runner.add(engine.encode(prompts[0]), SamplingParams(max_new_tokens=50), prompts[0])
    runner.step()
    cancelled.cancel()
    steps = 0
    while runner.has_work():
        runner.step()
        steps += 1
        assert runner.active_count() <= 4 and steps < 200
    assert cancelled.finished and cancelled.result is None
    for prompt, n, h in zip(prompts, budgets, handles):
        assert h.finished and h.error is None
        assert h.result.output_token_ids == hf_greedy(model, tokenizer, engine.encode(prompt), n)
        assert "".join(h.take_deltas()) == h.result.output_text


def test_generate_many_keeps_input_order(tokenizer):
    model = make_tiny_model("qwen2", tokenizer)
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    a, b = text_with_tokens(tokenizer, 40, seed=31), text_with_tokens(tokenizer, 40, seed=32)
    prompts = [a + " one", b + " two", a + " three", b + " four"]
    results = engine.generate_many(prompts, max_new_tokens=6)
    for prompt, r in zip(prompts, results):
        assert r.output_token_ids == hf_greedy(model, tokenizer, engine.encode(prompt), 6)


def test_batches_of_token_ids_match_their_text(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    a, b = text_with_tokens(tokenizer, 40, seed=41), text_with_tokens(tokenizer, 40, seed=42)
    prompts = [a + " one", b + " two", a + " three"]
    ids = [engine.encode(p) for p in prompts]
    by_text = engine.generate_many(prompts, max_new_tokens=6)
    for results in (engine.generate_batch(input_ids=ids, max_new_tokens=6),
                    engine.generate_many(input_ids=[torch.tensor(x, device=engine.device) for x in ids],
                                         max_new_tokens=6)):
        assert [r.output_token_ids for r in results] == [r.output_token_ids for r in by_text]
        assert [r.prompt_tokens for r in results] == [len(x) for x in ids]
    for call in (engine.generate_batch, engine.generate_many):
        with pytest.raises(InvalidRequestError, match="one of prompts or input_ids"):
            call(prompts, input_ids=ids)
        with pytest.raises(InvalidRequestError, match="one of prompts or input_ids"):
            call()
        with pytest.raises(InvalidRequestError, match="outside the model's vocabulary"):
            call(input_ids=[ids[0], [10**9]])
        with pytest.raises(InvalidRequestError, match="input_ids must be a non-empty list"):
            call(input_ids=[])


def test_seeded_sampling_in_a_batch_matches_single(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    prompts = [text_with_tokens(tokenizer, 30, seed=41), text_with_tokens(tokenizer, 50, seed=42)]
    batch = engine.generate_batch(prompts, max_new_tokens=8, temperature=0.8, seed=5)
    single = [engine.generate(p, 8, temperature=0.8, seed=5, mode="baseline") for p in prompts]
    assert [r.output_token_ids for r in batch] == [r.output_token_ids for r in single]


def _segment(start: int, n: int, layers: int = 2):
    from kvboost.reuse.match import Segment
    from kvboost.store.base import ChunkRecord

    keys = [torch.randn(2, n, 4) for _ in range(layers)]
    values = [torch.randn(2, n, 4) for _ in range(layers)]
    return Segment(ChunkRecord(f"k{start}", None, "c", tuple(range(start, start + n)), start, keys, values), start, n)


def test_shared_prefix_is_assembled_once_and_truncates_as_views():
    from kvboost.batch import SharedPrefix

    segs = [_segment(0, 4), _segment(4, 4), _segment(8, 4)]
    prefix = SharedPrefix.from_segments(list(range(10)), None, segs)
    assert prefix.length == 10 and prefix.keys[0].shape == (1, 2, 10, 4)
    assert torch.equal(prefix.values[1][0, :, 4:8], segs[1].record.values[1])
    assert torch.equal(prefix.keys[0][0, :, 8:10], segs[2].record.keys[0][:, :2])
    short = prefix.truncated(4)
    assert short.length == 4 and short.keys[0].data_ptr() == prefix.keys[0].data_ptr()
    assert prefix.truncated(0) is None
    with pytest.raises(ValueError):
        prefix.truncated(11)
    with pytest.raises(ValueError, match="cover"):
        SharedPrefix.from_segments(list(range(8)), None, [segs[0], segs[2]])


def test_shared_prefix_moves_store_records_to_the_engine_device(device):
    """Disk and Redis records live on the CPU; the shared prefix must sit where the queries are."""
    from kvboost.batch import SharedPrefix

    from ..devices import assert_on

    segs = [_segment(0, 4), _segment(4, 4)]  # CPU records, as the disk tier returns them
    prefix = SharedPrefix.from_segments(list(range(8)), None, segs, device)
    assert_on(device, prefix.keys, prefix.values)
    assert torch.equal(prefix.keys[1][0, :, 4:8].cpu(), segs[1].record.keys[1])


# ---- boundary window: chunk boundaries come from Chunker.spans, not multiples of chunk_size -------------------
def _next_cut(cuts: list[int], n: int) -> int | None:
    return next((c for c in cuts if c > n), None)


def test_find_common_chunk_prefix_with_a_boundary_window():
    import random

    from kvboost.chunking import Chunker
    from kvboost.reuse.match import common_prefix_length

    from ..test_chunking import _CLASSES, _random_ids

    chunker = Chunker(16, "ns", 5, _CLASSES)
    rng = random.Random(3)
    moved = False
    for _ in range(40):
        common = _random_ids(rng, rng.randrange(0, 120), 0.04, 0.3)
        rows = [common + _random_ids(rng, rng.randrange(1, 40), 0.04, 0.3) for _ in range(3)]
        n = find_common_chunk_prefix(rows, 16, chunker)
        cuts = [[stop for _, stop, done in chunker.spans(r) if done] for r in rows]
        same = min(common_prefix_length(rows[0], r) for r in rows[1:])
        assert n <= same and (n == 0 or all(n in c for c in cuts))
        # The rows' chunk chains agree up to n (same keys), and the next cut is not shared by all of them.
        chains = [[c.prefix_key for c in chunker.split(r) if c.end <= n] for r in rows]
        assert chains[0] == chains[1] == chains[2]
        nxt = {_next_cut(c, n) for c in cuts}
        assert len(nxt) > 1 or None in nxt or next(iter(nxt)) > same
        moved |= n % 16 != 0
    assert moved  # the answer is not always a multiple of chunk_size
    assert find_common_chunk_prefix([[1, 2, 3, 4, 5], [1, 2, 3, 4, 9]], 2, Chunker(2, "ns")) == 4


def test_group_by_prefix_with_a_boundary_window():
    import random

    from kvboost.chunking import Chunker

    from ..test_chunking import _CLASSES, _random_ids

    rng = random.Random(4)
    chunker = Chunker(8, "ns", 3, _CLASSES)
    base = _random_ids(rng, 40, 0.1, 0.3)
    ids = [base + [50] * 5, base[:30] + [60] * 20, [70] * 30]  # two complete chunks end by 22, decided by 25
    groups = group_by_prefix(["a", "b", "c"], ids, 8, n_prefix_chunks=2, chunker=chunker)
    assert sorted(groups.values()) == [[0, 1], [2]]
    second_cut = [stop for _, stop, done in chunker.spans(ids[0]) if done][1]
    assert tuple(ids[0][:second_cut]) in groups


def test_generate_batch_with_a_boundary_window(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK, chunk_boundary_window=6)
    system = " ".join(words(3 + i % 7, seed=i).capitalize() + "." for i in range(10))
    prompts = [system + " " + words(n, seed=n) for n in (3, 9, 17, 5)]
    results = engine.generate_batch(prompts, max_new_tokens=10)
    encoded = [engine.encode(p) for p in prompts]
    shared = find_common_chunk_prefix([ids[:-1] for ids in encoded], CHUNK, engine.chunker)
    assert shared >= 3 * CHUNK
    for ids, result in zip(encoded, results):
        assert result.output_token_ids == hf_greedy(model, tokenizer, ids, 10)
        assert result.cached_tokens >= shared
    many = engine.generate_many(prompts + [words(40, seed=7)], max_new_tokens=6)
    for prompt, r in zip(prompts + [words(40, seed=7)], many):
        assert r.output_token_ids == hf_greedy(model, tokenizer, engine.encode(prompt), 6)
