"""Scheduler with a shared prefix: one prefix K/V for all rows, never copied into slots, exact outputs."""
from __future__ import annotations

import random

import pytest
import torch
from transformers.cache_utils import DynamicCache

from kvboost import GenerationMode, KVBoost
from kvboost.batch import cascade
from kvboost.model.cache_arg import cache_kwargs, returned_cache
from kvboost.sampling import SamplingParams
from kvboost.scheduler import CASCADE_MIN_TOKENS, Scheduler

from .hf_reference import hf_greedy
from .prompts import text_with_tokens, words
from .tiny_models import make_tiny_model

CHUNK = 16


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 20000) for _ in range(n)]


@pytest.fixture
def prefix_reads(monkeypatch):
    """Every shared-prefix attention call as (prefix key data_ptr, prefix batch dim, rows in the call)."""
    calls: list[tuple[int, int, int]] = []
    real = cascade.shared_prefix_attention

    def spy(query, key, value, prefix_key, prefix_value, mask, scaling):
        calls.append((prefix_key.data_ptr(), prefix_key.shape[0], query.shape[0]))
        return real(query, key, value, prefix_key, prefix_value, mask, scaling)

    monkeypatch.setattr(cascade, "shared_prefix_attention", spy)
    return calls


def _prefix_columns_untouched(runner: Scheduler) -> bool:
    """Rows neither hold nor allocate the shared prefix: the workspace's first column is position P."""
    p, ws = runner.prefix.length, runner.ws
    for i in range(len(ws.shapes)):
        k, v = ws.buffers(i)
        if k.shape[2] != ws.capacity - p or v.shape[2] != ws.capacity - p:
            return False
    return ws.base == p


def _cascade_engine(model, tokenizer, **options) -> KVBoost:
    """An engine whose batches share prefixes through cascade attention on every device. With a runner (CUDA
    graphs: fast_path "auto" on CUDA) a Scheduler copies prefixes shorter than CASCADE_MIN_TOKENS per row
    instead, so these tests of the shared-prefix path turn the fast path off."""
    engine = KVBoost(model, tokenizer, fast_path="off", **options)
    assert engine.runner is None
    return engine


def _add(runner, ids, n):
    return runner.add(ids, SamplingParams(max_new_tokens=n), "prompt")


def _drain(runner, check=None, limit=300):
    steps = 0
    while runner.has_work():
        runner.step()
        if check is not None:
            check()
        steps += 1
        assert steps < limit


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rows_sharing_a_prefix_read_one_copy_and_match_sequential(arch, tokenizer, prefix_reads):
    model = make_tiny_model(arch, tokenizer)
    engine = _cascade_engine(model, tokenizer, chunk_size=CHUNK)
    system = text_with_tokens(tokenizer, 3 * CHUNK + 5, seed=1)
    prompts = [system + " " + words(n, seed=n) for n in (3, 9, 17, 5)]
    runner = Scheduler(engine, max_batch_size=4)
    handles = [_add(runner, engine.encode(p), 10) for p in prompts]
    runner.step()
    assert runner.prefix is not None and runner.prefix.length >= 3 * CHUNK
    shared = runner.prefix
    ptrs = {k.data_ptr() for k in shared.keys}

    def check():
        if runner.active_count():
            assert runner.prefix is shared and _prefix_columns_untouched(runner)

    _drain(runner, check)
    assert runner.prefix is None  # dropped when the batch empties
    assert model.config._attn_implementation == "sdpa"  # only the runner's forwards were switched
    # Every attention call read one [1, ...] prefix tensor of this batch, also in steps decoding all 4 rows.
    assert prefix_reads and all(ptr in ptrs and pb == 1 for ptr, pb, _ in prefix_reads)
    assert max(rows for _, _, rows in prefix_reads) == 4
    reference = KVBoost(model, tokenizer, chunk_size=CHUNK)
    for prompt, h in zip(prompts, handles):
        assert h.error is None and h.result.cached_tokens >= 3 * CHUNK
        assert h.result.output_token_ids == reference.generate(prompt, 10, mode="baseline").output_token_ids


def test_rows_joining_with_the_same_prefix_keep_it(tokenizer, prefix_reads):
    model = make_tiny_model("llama", tokenizer)
    engine = _cascade_engine(model, tokenizer, chunk_size=CHUNK)
    system = _ids(3 * CHUNK, seed=1)
    prompts = [system + _ids(n, seed=n) for n in (4, 11, 7, 20)]
    budgets = [12, 5, 9, 6]
    handles = [_add(runner := Scheduler(engine, max_batch_size=4), prompts[0], budgets[0]),
               _add(runner, prompts[1], budgets[1])]
    runner.step()
    shared = runner.prefix
    assert shared is not None and shared.length == 3 * CHUNK
    runner.step()
    handles += [_add(runner, prompts[2], budgets[2]), _add(runner, prompts[3], budgets[3])]
    runner.step()
    assert runner.prefix is shared and runner.active_count() == 4 and _prefix_columns_untouched(runner)
    _drain(runner, lambda: not runner.active_count() or _prefix_columns_untouched(runner) or pytest.fail("copied"))
    for ids, n, h in zip(prompts, budgets, handles):
        assert h.result.output_token_ids == hf_greedy(model, tokenizer, ids, n)


def test_a_row_with_another_prefix_shrinks_the_shared_part(tokenizer):
    model = make_tiny_model("qwen2", tokenizer)
    engine = _cascade_engine(model, tokenizer, chunk_size=CHUNK)
    system = _ids(3 * CHUNK, seed=1)
    prompts = [system + _ids(n, seed=n) for n in (5, 9, 13)]
    runner = Scheduler(engine, max_batch_size=6)
    handles = [_add(runner, ids, 14) for ids in prompts]
    runner.step()
    assert runner.prefix.length == 3 * CHUNK
    # Shares only the first chunk: the shared prefix shrinks to it; active rows get their own copy of the rest.
    partial = system[:CHUNK] + _ids(20, seed=77)
    handles.append(_add(runner, partial, 10))
    runner.step()
    assert runner.prefix.length == CHUNK and _prefix_columns_untouched(runner)
    k0, _ = runner.ws.buffers(0)  # columns from position CHUNK on
    assert all(k0[r.slot, :, :2 * CHUNK].abs().sum() > 0 for r in runner._active)
    # Shares nothing: back to the per-row layout, every row holding its whole K/V.
    other = _ids(30, seed=99)
    handles.append(_add(runner, other, 8))
    runner.step()
    assert runner.prefix is None and runner.ws.base == 0
    k0, _ = runner.ws.buffers(0)
    assert all(k0[r.slot, :, :CHUNK].abs().sum() > 0 for r in runner._active)
    _drain(runner)
    for ids, h in zip(prompts + [partial, other], handles):
        assert h.error is None
        assert h.result.output_token_ids == hf_greedy(model, tokenizer, ids, h.result.generated_tokens)
    assert [h.result.generated_tokens for h in handles] == [14, 14, 14, 10, 8]


def test_cancel_and_release_move_only_a_rows_own_columns(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    engine = _cascade_engine(model, tokenizer, chunk_size=CHUNK)
    system = _ids(2 * CHUNK, seed=3)
    prompts = [system + _ids(n, seed=10 + n) for n in (3, 8, 5, 12, 6)]
    budgets = [3, 14, 6, 11, 9]
    runner = Scheduler(engine, max_batch_size=4)
    handles = [_add(runner, ids, n) for ids, n in zip(prompts, budgets)]  # the fifth waits for a free slot
    runner.step()
    runner.step()
    handles[1].cancel()
    seen_prefix = []

    def check():
        if runner.active_count():
            seen_prefix.append(runner.prefix.length)
            assert _prefix_columns_untouched(runner)

    _drain(runner, check)
    assert set(seen_prefix) == {2 * CHUNK}
    assert handles[1].finished and handles[1].result is None
    for i, (ids, n, h) in enumerate(zip(prompts, budgets, handles)):
        if i != 1:
            assert h.result.output_token_ids == hf_greedy(model, tokenizer, ids, n)


def test_every_row_keeps_a_token_after_the_prefix(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    engine = _cascade_engine(model, tokenizer, chunk_size=CHUNK)
    system = _ids(3 * CHUNK, seed=5)
    prompts = [system, system + _ids(9, seed=6)]  # the first is exactly the 3-chunk prefix
    runner = Scheduler(engine, max_batch_size=2)
    handles = [_add(runner, ids, 6) for ids in prompts]
    runner.step()
    assert runner.prefix.length == 2 * CHUNK
    _drain(runner)
    for ids, h in zip(prompts, handles):
        assert h.result.output_token_ids == hf_greedy(model, tokenizer, ids, 6)


def test_write_back_stores_the_prefix_from_the_shared_tensor(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    engine = _cascade_engine(model, tokenizer, chunk_size=CHUNK)
    system = text_with_tokens(tokenizer, 2 * CHUNK + 3, seed=8)
    prompts = [system + " " + words(n, seed=40 + n) for n in (6, 13)]
    runner = Scheduler(engine, max_batch_size=2)
    handles = [_add(runner, engine.encode(p), 20) for p in prompts]
    runner.step()
    assert runner.prefix.length == 2 * CHUNK
    engine.clear_cache()  # write-back must now store the prefix chunks too, read from the shared tensor
    _drain(runner)
    for prompt, h in zip(prompts, handles):
        fed = engine.encode(prompt) + h.result.output_token_ids[:-1]
        with torch.inference_mode():
            full = model(input_ids=torch.tensor([fed], device=model.device), **cache_kwargs(DynamicCache()),
                         use_cache=True)
        for chunk in engine.chunker.split(fed):
            record = engine.store.get(chunk.prefix_key)
            assert record is not None and record.token_ids == chunk.token_ids
            for i, layer in enumerate(returned_cache(full).layers):
                torch.testing.assert_close(record.keys[i], layer.keys[0, :, chunk.start:chunk.end], atol=1e-5, rtol=0)
                torch.testing.assert_close(record.values[i], layer.values[0, :, chunk.start:chunk.end],
                                           atol=1e-5, rtol=0)
        engine.forget_workspace()
        single = engine.generate(prompt, 20)
        assert single.cached_tokens == len(engine.encode(prompt)) - 1
        assert single.output_token_ids == h.result.output_token_ids


def test_with_a_runner_rows_copy_a_short_prefix_and_match_sequential(tokenizer, device):
    """An engine with a runner (CUDA graphs by default on CUDA; fast_path="eager" on the CPU, whose default has
    none) decodes batches through it: a prefix shorter than CASCADE_MIN_TOKENS is copied into every row."""
    model = make_tiny_model("llama", tokenizer)
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK, fast_path="auto" if device.type == "cuda" else "eager")
    assert engine.runner is not None
    system = _ids(3 * CHUNK, seed=1)
    assert len(system) < CASCADE_MIN_TOKENS
    prompts = [system + _ids(n, seed=n) for n in (4, 11, 7)]
    runner = Scheduler(engine, max_batch_size=4)
    assert runner.shared_prefix_off_reason is None and runner.runner is not None
    handles = [_add(runner, ids, 8) for ids in prompts]
    runner.step()
    assert runner.prefix is None and runner.ws.base == 0
    k0, _ = runner.ws.buffers(0)
    assert all(k0[r.slot, :, :len(system)].abs().sum() > 0 for r in runner._active)  # every row holds the prefix
    _drain(runner, lambda: runner.prefix is None or pytest.fail("shared a short prefix"))
    assert runner.runner.stats["steps"] > 0  # the decode steps ran through the runner
    for ids, h in zip(prompts, handles):
        assert h.error is None and h.result.cached_tokens >= 3 * CHUNK
        assert h.result.output_token_ids == hf_greedy(model, tokenizer, ids, 8)


def test_shared_prefix_attention_can_be_turned_off(tokenizer, prefix_reads):
    model = make_tiny_model("llama", tokenizer)
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK, shared_prefix_attention=False)
    system = _ids(2 * CHUNK, seed=9)
    prompts = [system + _ids(n, seed=n) for n in (4, 7)]
    for runner in (Scheduler(engine, max_batch_size=2),
                   Scheduler(KVBoost(model, tokenizer, chunk_size=CHUNK), 2, shared_prefix_attention=False)):
        assert runner.shared_prefix_off_reason == "disabled"
        handles = [_add(runner, ids, 5) for ids in prompts]
        runner.step()
        assert runner.prefix is None
        k0, _ = runner.ws.buffers(0)
        assert k0[:2, :, :2 * CHUNK].abs().sum() > 0  # the old layout: every row holds the prefix
        _drain(runner)
        for ids, h in zip(prompts, handles):
            assert h.result.output_token_ids == hf_greedy(model, tokenizer, ids, 5)
    assert not prefix_reads
    assert Scheduler(KVBoost(model, tokenizer, chunk_size=CHUNK)).shared_prefix_off_reason is None
    with pytest.raises(TypeError):
        Scheduler(engine, shared_prefix_attention="yes")
    with pytest.raises(ValueError, match="shared_prefix_attention"):
        KVBoost(model, tokenizer, shared_prefix_attention=1)


def test_sliding_window_models_keep_the_per_row_path(tokenizer):
    engine = KVBoost(make_tiny_model("gemma3", tokenizer), tokenizer, chunk_size=CHUNK)
    runner = Scheduler(engine, max_batch_size=4)
    assert "sliding" in runner.shared_prefix_off_reason


@pytest.mark.slow
def test_smollm2_rows_sharing_a_system_prompt(smol):
    model, tokenizer = smol
    chunk = 32
    engine = _cascade_engine(model, tokenizer, chunk_size=chunk)
    system = text_with_tokens(tokenizer, 2 * chunk + 10, seed=11)
    prompts = [system + " Question: " + words(n, seed=60 + n) + "?" for n in (4, 9, 6, 12)]
    runner = Scheduler(engine, max_batch_size=4)
    handles = [_add(runner, engine.encode(p), 8) for p in prompts]
    runner.step()
    assert runner.prefix is not None and runner.prefix.length >= 2 * chunk and _prefix_columns_untouched(runner)
    _drain(runner)
    reference = KVBoost(model, tokenizer, chunk_size=chunk)
    for prompt, h in zip(prompts, handles):
        assert h.result.output_token_ids == reference.generate(prompt, 8, mode="baseline").output_token_ids


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_boundary_window_shared_prefix_ends_on_every_rows_cut(arch, tokenizer):
    """W = 7 with 16-token chunks: the last chunks of a truncated prefix may be cut differently from the rows'
    own, so the prefix is warmed and loaded as the rows' chunks; it ends on a cut of every row."""
    from kvboost.batch import find_common_chunk_prefix

    model = make_tiny_model(arch, tokenizer)
    engine = _cascade_engine(model, tokenizer, chunk_size=CHUNK, chunk_boundary_window=7)
    system = " ".join(words(2 + (3 * i) % 8, seed=i).capitalize() + "." for i in range(9))
    prompts = [system + " " + words(n, seed=n).capitalize() + "?" for n in (4, 10, 7, 15)]
    encoded = [engine.encode(p) for p in prompts]
    shared = find_common_chunk_prefix([ids[:-1] for ids in encoded], CHUNK, engine.chunker)
    assert shared >= 3 * CHUNK and shared % CHUNK != 0
    for ids in encoded:
        assert shared in {c.end for c in engine.chunker.split(ids) if c.complete}
    runner = Scheduler(engine, max_batch_size=4)
    handles = [_add(runner, ids, 8) for ids in encoded]
    runner.step()
    assert runner.prefix is not None and runner.prefix.length == shared and _prefix_columns_untouched(runner)
    _drain(runner)
    for ids, h in zip(encoded, handles):
        assert h.error is None and h.result.cached_tokens >= shared
        assert h.result.output_token_ids == hf_greedy(model, tokenizer, ids, 8)


@pytest.mark.parametrize("case", ["cut_after_shared_tokens", "short_chunks"])
def test_boundary_window_rows_cut_differently_right_after_the_shared_tokens(case, tokenizer):
    """Token-level cases (16-token chunks, W = 7; " river" starts a word, "." ends a sentence):
    cut_after_shared_tokens: the rows share 53 tokens, but a "." at 53 makes the second row cut at 54 where the
    first cuts at 48; every row's chunks are stored. The shared prefix must stop at 32 (the last cut of both):
    a prefix of 48 would leave the second row's positions 48-53 without K/V.
    short_chunks: "." at 10 and 21 cut at 11 and 22; ids[:22] alone would be one 22-token remainder, so the
    shared prefix is warmed and loaded as the rows' own two chunks."""
    from kvboost.batch import find_common_chunk_prefix

    model = make_tiny_model("llama", tokenizer)
    engine = _cascade_engine(model, tokenizer, chunk_size=CHUNK, chunk_boundary_window=7)
    word, dot = (tokenizer(t)["input_ids"][0] for t in (" river", "."))
    tails = [tokenizer(" " + words(12, seed=s))["input_ids"] for s in (1, 2)]
    if case == "cut_after_shared_tokens":
        rows, expected = [[word] * 53 + tails[0], [word] * 53 + [dot] + tails[1]], 32
        for ids in rows:
            engine.warm_ids(ids, None)
    else:
        shared = [word] * 10 + [dot] + [word] * 10 + [dot] + [word] * 14
        rows, expected = [shared + [dot] + tails[0], shared + [word, word, dot] + tails[1]], 22
    assert find_common_chunk_prefix([ids[:-1] for ids in rows], CHUNK, engine.chunker) == expected
    runner = Scheduler(engine, max_batch_size=2)
    handles = [_add(runner, ids, 8) for ids in rows]
    runner.step()
    assert runner.prefix is not None and runner.prefix.length == expected
    _drain(runner)
    for ids, h in zip(rows, handles):
        assert h.error is None and h.result.cached_tokens >= expected
        assert h.result.output_token_ids == hf_greedy(model, tokenizer, ids, 8)


def test_grow_ahead_grows_a_well_filled_workspace_between_requests_keeping_what_it_holds(tokenizer):
    """The server's idle loop calls grow_ahead: a conversation's next turn then finds room (no allocation inside its
    time to first token), reuses everything it held, and answers as without the early growth."""
    engine = KVBoost(make_tiny_model("llama", tokenizer, device="cpu"), tokenizer, device="cpu", chunk_size=CHUNK)
    ws = engine.kv_workspace
    assert not engine.grow_ahead()  # nothing held yet
    prompt = _ids(20, seed=3)
    engine.generate(input_ids=prompt, max_new_tokens=4)
    while max(len(r.ids) for r in ws.residents) <= 0.75 * ws.capacity:  # a conversation that has grown
        prompt = _ids(len(prompt) + 40, seed=3)
        engine.generate(input_ids=prompt, max_new_tokens=4)
    capacity, held = ws.capacity, list(ws.residents[0].ids)
    assert engine.grow_ahead()
    assert ws.capacity > capacity and list(ws.residents[0].ids) == held
    assert not engine.grow_ahead()  # room enough now
    follow_up = prompt + _ids(8, seed=4)
    again = engine.generate(input_ids=follow_up, max_new_tokens=6)
    assert ws.capacity > capacity and again.cached_tokens >= len(prompt) - CHUNK
    assert list(again.output_token_ids) == hf_greedy(engine.model, tokenizer, follow_up, 6)


def test_a_failed_early_growth_keeps_the_workspace_and_is_not_retried(tokenizer, monkeypatch):
    engine = KVBoost(make_tiny_model("llama", tokenizer, device="cpu"), tokenizer, device="cpu", chunk_size=CHUNK)
    ws = engine.kv_workspace
    prompt = _ids(20, seed=5)
    while not ws.residents[0].ids or max(len(r.ids) for r in ws.residents) <= 0.75 * ws.capacity:
        prompt = _ids(len(prompt) + 40, seed=5)
        engine.generate(input_ids=prompt, max_new_tokens=4)
    capacity, held = ws.capacity, list(ws.residents[0].ids)
    calls = []

    def out_of_memory(*args, **kwargs):
        calls.append(args)
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(torch, "zeros", out_of_memory)
    assert not engine.grow_ahead() and not engine.grow_ahead()
    monkeypatch.undo()
    assert len(calls) == 1 and ws.capacity == capacity and list(ws.residents[0].ids) == held
    again = engine.generate(input_ids=prompt + _ids(8, seed=6), max_new_tokens=4)  # grows as it needs
    assert again.cached_tokens >= len(prompt) - CHUNK
    assert list(again.output_token_ids) == hf_greedy(engine.model, tokenizer, prompt + _ids(8, seed=6), 4)


# ---- a lone row reading a stored prefix in place ----------------------------------------------------------------
def _in_place_engine(tokenizer, monkeypatch, **options):
    from kvboost import scheduler

    monkeypatch.setattr(scheduler, "IN_PLACE_MIN_TOKENS", 2 * CHUNK)
    monkeypatch.setattr(scheduler, "CASCADE_MIN_TOKENS", 4 * CHUNK)
    return KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=CHUNK, **options)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stored_prefix_is_read_in_place_then_placed_after_the_first_token(tokenizer, monkeypatch, prefix_reads,
                                                                            stream):
    engine = _in_place_engine(tokenizer, monkeypatch)
    system = _ids(100, seed=40)
    engine.warm_ids(system)
    span = engine.kv.lookup(system + [5], None, GenerationMode.CHUNK_KV_REUSE).segments[0].record.span
    engine.forget_workspace()
    placed = []
    real = Scheduler._place_unplaced

    def spy(self, row):
        placed.append((row.unplaced, len(row.tracker.tokens)))
        real(self, row)

    monkeypatch.setattr(Scheduler, "_place_unplaced", spy)
    prompt = system + _ids(9, seed=41)
    want = hf_greedy(engine.model, tokenizer, prompt, 6)
    if stream:
        deltas = engine.generate_stream(input_ids=prompt, max_new_tokens=6)
        text = "".join(deltas)
        result = deltas.result
        assert text == result.output_text
    else:
        result = engine.generate(input_ids=prompt, max_new_tokens=6)
    assert result.output_token_ids == want
    # Positions [0, 96) were read where the store holds them (the span itself), then copied once the first token was
    # out; every later step ran over the row's own slot.
    assert placed == [(6 * CHUNK, 1)]
    assert [p for p, _, _ in prefix_reads] == [k.data_ptr() for k in span.keys]  # the prefill only, every layer
    assert result.cached_tokens == len(system)  # the remainder [96, 100) copied before the prefill, as before
    # The slot holds the prompt (and what was fed) from position 0: the next turn reuses it resident.
    plan = engine.kv.lookup(prompt + [1], None, GenerationMode.CHUNK_KV_REUSE, resident=engine.workspace.resident_ids)
    assert plan.resident >= len(prompt)


def test_reading_in_place_gives_the_first_token_logits_of_the_copy(tokenizer, monkeypatch):
    from kvboost import scheduler

    engine = _in_place_engine(tokenizer, monkeypatch)
    system = _ids(120, seed=42)
    engine.warm_ids(system)
    prompt = system + _ids(7, seed=43)
    logits = []
    for min_tokens in (2 * CHUNK, 10 ** 9):  # in place, then copied first
        monkeypatch.setattr(scheduler, "IN_PLACE_MIN_TOKENS", min_tokens)
        engine.forget_workspace()
        logits.append(engine.generate(input_ids=prompt, max_new_tokens=1, return_logits=True).first_token_logits)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def test_reading_in_place_follows_the_shared_prefix_option(tokenizer, monkeypatch, prefix_reads):
    engine = _in_place_engine(tokenizer, monkeypatch, shared_prefix_attention=False)
    system = _ids(100, seed=44)
    engine.warm_ids(system)
    engine.forget_workspace()
    prompt = system + _ids(5, seed=45)
    assert engine.generate(input_ids=prompt, max_new_tokens=4).output_token_ids == hf_greedy(engine.model, tokenizer,
                                                                                             prompt, 4)
    assert prefix_reads == []  # copied into the slot first, as before


def test_a_long_resident_reuse_is_attended_as_the_rows_prefix(tokenizer, monkeypatch, prefix_reads):
    engine = _in_place_engine(tokenizer, monkeypatch)
    short = _ids(50, seed=49)  # a reuse shorter than CASCADE_MIN_TOKENS: the plain prefill
    engine.generate(input_ids=short + [7, 8], max_new_tokens=2)
    engine.generate(input_ids=short + [9, 10], max_new_tokens=2)
    assert prefix_reads == []
    system = _ids(90, seed=46)
    first = system + _ids(6, seed=47)
    engine.generate(input_ids=first, max_new_tokens=3)  # nothing stored before: computed, left resident
    assert prefix_reads == []
    second = system + _ids(8, seed=48)
    result = engine.generate(input_ids=second, max_new_tokens=5)
    assert result.output_token_ids == hf_greedy(engine.model, tokenizer, second, 5)
    assert result.cached_tokens == len(system)
    # The prefix part read the slot's own columns: the workspace buffers, not a copy.
    assert [p for p, _, _ in prefix_reads] == [engine.workspace.buffers(i)[0].data_ptr()
                                               for i in range(len(engine.workspace.shapes))]
