"""TableRunner (model/table_runner.py): fixed-shape steps over a block table give model/paged.py's eager forward,
write nothing outside the table's own positions (and the runner's scratch block), and run in the engine.

On CPU the steps run eagerly (mode "eager", the gather path and the Triton kernel under its interpreter); on CUDA
the same tests also capture and replay graphs.
"""
from __future__ import annotations

import pytest
import torch

from kvboost import KVBoost
from kvboost.chunking import Chunker
from kvboost.kv.block_cache import BlockCache
from kvboost.kv.block_table import BlockTable
from kvboost.kv.blocks import BlockLayout, BlockPool
from kvboost.kv.paged_kv import PagedKV
from kvboost.model.forward import probe_layer_shapes
from kvboost.model.paged import paged_forward
from kvboost.model.table_runner import TableRunner, width_bucket

from ..prompts import text_with_tokens, words
from ..tiny_models import make_tiny_model

CHUNK, BS = 16, 8
TOL = dict(atol=1e-5, rtol=1e-5)


def _modes(device: torch.device) -> list[str]:
    return ["eager", "graphs"] if device.type == "cuda" else ["eager"]


def _pool(model, num_blocks: int = 48) -> BlockPool:
    shapes, dtype = probe_layer_shapes(model)
    return BlockPool(BlockLayout.for_layers(shapes, BS, dtype), num_blocks, next(model.parameters()).device)


def test_width_buckets_are_powers_of_two_from_eight():
    assert [width_bucket(n) for n in (0, 1, 8, 9, 16, 17, 300)] == [8, 8, 8, 16, 16, 32, 512]


def _stored_prefix(model, pool: BlockPool, tokenizer) -> tuple[PagedKV, list[int]]:
    """A paged KV holding a 2.5-chunk prefix (its last block partly filled) and the ids of a prompt over it."""
    kv = PagedKV(Chunker(CHUNK, "ns"), pool, BlockCache(pool))
    prefix = tokenizer(words(40, seed=1))["input_ids"][:2 * CHUNK + 3]
    writer = BlockTable(pool)
    paged_forward(model, prefix, writer, backend="sdpa")
    kv.write_back(writer, prefix, None)
    writer.release()
    return kv, prefix + tokenizer(" " + words(9, seed=2))["input_ids"]


def _run(model, kv: PagedKV, ids: list[int], step, decode: int) -> tuple[list[torch.Tensor], torch.Tensor, list]:
    """Prefill ids over the stored prefix, `decode` greedy steps, then a 3-token verify; (logits, verify logits,
    the table's blocks)."""
    plan = kv.lookup(ids, None)
    table = plan.table
    logits = [step(ids[plan.reuse_len:], table, False).clone()]
    for _ in range(decode):
        logits.append(step([int(logits[-1].argmax())], table, False).clone())
    start = table.length
    verify = step([int(logits[-1].argmax()), 5, 6], table, True).clone()
    assert table.length == start + 3
    blocks = list(table.blocks)
    table.release()
    return logits, verify, blocks


def _eager_step(model, backend):
    def step(tokens, table, all_logits):
        out = paged_forward(model, tokens, table, backend=backend, logits_to_keep=len(tokens) if all_logits else 1)
        return out[0] if all_logits else out[0, -1]
    return step


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_table_steps_match_the_eager_forward_over_a_stored_prefix(tokenizer, device, arch):
    model = make_tiny_model(arch, tokenizer, device=device)
    for mode in _modes(device):
        pool = _pool(model)
        kv, ids = _stored_prefix(model, pool, tokenizer)
        stored = pool.storage[[b for c in kv.cache.children(None) for b in c.blocks]].clone()
        runner = TableRunner(model, pool, mode=mode, backend="triton" if mode == "graphs" else "sdpa")
        with torch.inference_mode():
            want, want_verify, _ = _run(model, kv, ids, _eager_step(model, "sdpa"), decode=5)
            got, got_verify, blocks = _run(model, kv, ids, runner.forward, decode=5)
        assert [int(x.argmax()) for x in got] == [int(x.argmax()) for x in want]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **TOL)
        torch.testing.assert_close(got_verify, want_verify, **TOL)
        assert got_verify.shape[0] == 3
        # What the cache holds never changed (the prompt's write into its partial block was copied first) ...
        assert torch.equal(pool.storage[[b for c in kv.cache.children(None) for b in c.blocks]], stored)
        # ... and nothing besides the table's blocks, the cache's and the scratch block was ever taken.
        assert runner.scratch_block not in blocks
        steps = runner.stats.as_dict()
        assert steps["steps"] == 7 and (mode == "eager" or steps["captures"] >= 3)


def test_table_steps_through_the_triton_kernel(tokenizer, kernel_device):
    model = make_tiny_model("llama", tokenizer, device=kernel_device)
    pool = _pool(model)
    kv, ids = _stored_prefix(model, pool, tokenizer)
    runner = TableRunner(model, pool, mode="eager", backend="triton")
    with torch.inference_mode():
        want, want_verify, _ = _run(model, kv, ids, _eager_step(model, "sdpa"), decode=2)
        got, got_verify, _ = _run(model, kv, ids, runner.forward, decode=2)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    torch.testing.assert_close(got_verify, want_verify, **TOL)


def test_a_step_that_raises_cuts_the_table_back(tokenizer, device, monkeypatch):
    model = make_tiny_model("llama", tokenizer, device=device)
    pool = _pool(model)
    runner = TableRunner(model, pool, mode="eager")
    table = BlockTable(pool)
    with torch.inference_mode():
        runner.forward(tokenizer(words(5, seed=3))["input_ids"], table)
    length, used = table.length, pool.num_used

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(model, "forward", broken)
    with pytest.raises(RuntimeError, match="device lost"), torch.inference_mode():
        runner.forward(list(range(40, 60)), table)
    assert table.length == length and pool.num_used == used
    with pytest.raises(ValueError, match="largest bucket"):
        runner.forward([1] * 300, table)
    with pytest.raises(ValueError, match="at least one token"):
        runner.forward([], table)
    assert table.length == length
    table.release()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_table_requests_run_through_the_runner(tokenizer, device, arch):
    """paged_attention="table": the fast path's steps give fast_path="off"'s tokens, prompt after prompt over a
    shared prefix (suffixes, decode, speculative verifies), and cache_stats() counts them."""
    model = make_tiny_model(arch, tokenizer, device=device)
    prefix = text_with_tokens(tokenizer, 3 * CHUNK + 5, seed=7)
    prompts = [prefix + " " + words(n, seed=n) for n in (4, 11, 30)] + [prefix + " " + prefix]
    for mode in _modes(device):
        off = KVBoost(model, tokenizer, chunk_size=CHUNK, paged_kv=True, paged_attention="table", fast_path="off")
        fast = KVBoost(model, tokenizer, chunk_size=CHUNK, paged_kv=True, paged_attention="table", fast_path=mode)
        for prompt in prompts:
            for spec in (None, "prompt_lookup"):
                want = off.generate(prompt, max_new_tokens=12, speculative=spec)
                got = fast.generate(prompt, max_new_tokens=12, speculative=spec)
                assert got.output_token_ids == want.output_token_ids and got.cached_tokens == want.cached_tokens
        table = fast.cache_stats()["fast_path"]["table"]
        assert table["mode"] == mode and table["steps"] > 40 and table["failure"] is None


def test_sampling_stops_and_streams_over_the_runner(tokenizer, device):
    """Seeded sampling, a stop string and streamed text over table steps equal fast_path="off"'s."""
    model = make_tiny_model("llama", tokenizer, device=device)
    prefix = text_with_tokens(tokenizer, 2 * CHUNK + 3, seed=8)
    engines = [KVBoost(model, tokenizer, chunk_size=CHUNK, paged_kv=True, paged_attention="table", fast_path=mode)
               for mode in ("off", _modes(device)[-1])]
    for prompt in (prefix + " one", prefix + " two and three"):
        sampled = [e.generate(prompt, max_new_tokens=16, temperature=0.8, top_p=0.9, seed=3) for e in engines]
        assert sampled[0].output_token_ids == sampled[1].output_token_ids
        stop = sampled[0].output_text[4:7] or "x"
        stopped = [e.generate(prompt, max_new_tokens=16, stop=[stop]) for e in engines]
        assert stopped[0].output_text == stopped[1].output_text
        streams = [e.generate_stream(prompt, max_new_tokens=10) for e in engines]
        texts = ["".join(stream) for stream in streams]
        assert texts[0] == texts[1] == streams[1].result.output_text


def test_compiled_fast_path_over_tables_is_refused(tokenizer, device):
    if device.type != "cpu":
        pytest.skip("fast_path='compiled' is the CPU path")
    with pytest.raises(ValueError, match="paged_attention='table'"):
        KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=CHUNK, paged_kv=True,
                paged_attention="table", fast_path="compiled")


def test_least_recently_used_steps_go_past_the_cap(tokenizer, device, monkeypatch):
    from kvboost.model import table_runner

    monkeypatch.setattr(table_runner, "MAX_STEPS", 2)
    model = make_tiny_model("llama", tokenizer, device=device)
    runner = TableRunner(model, _pool(model), mode="eager", buckets=(16, 32))
    table = BlockTable(runner.pool)
    with torch.inference_mode():
        for n in (3, 20, 1, 4):  # steps (seq, 16), (seq, 32), (seq, 1), (seq, 16) again
            runner.forward(list(range(10, 10 + n)), table)
    assert [key[:2] for key in runner.steps] == [("seq", 1), ("seq", 16)]
    table.release()


def test_a_table_step_never_syncs_the_host(tokenizer, device):
    """What a graph captures must not wait on the device (a sync inside a capture fails it, and auto mode would then
    run eagerly for good): the step's forward runs under torch's sync debug mode set to raise."""
    if device.type != "cuda":
        pytest.skip("host syncs exist on CUDA only")
    model = make_tiny_model("llama", tokenizer, device=device)
    pool = _pool(model)
    runner = TableRunner(model, pool, mode="eager", backend="triton")
    table = BlockTable(pool)
    with torch.inference_mode():
        runner.forward(tokenizer(words(20, seed=4))["input_ids"], table)  # compiles the kernels
        runner.forward([7], table)
        step = runner.steps[("seq", 1, 8)]
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            runner._run(step)  # noqa: SLF001 - exactly what capture_step records
        finally:
            torch.cuda.set_sync_debug_mode("default")
    table.release()
