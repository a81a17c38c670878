"""ModelRunner (model/runner.py): bucketed static steps give the ordinary path's output, in every mode it runs.

On CPU the bucket logic runs eagerly (fast_path="eager"); on CUDA the same tests also run captured graphs.
"""
from __future__ import annotations

import pytest
import torch

from kvboost import KVBoost
from kvboost.model.runner import ModelRunner, bucket_for, static_path_unsupported_reason

from ..tiny_models import make_tiny_model
from .compiled_engines import plain_and_compiled

STATIC_ARCHS = ["llama", "qwen2", "phi3"]


def _prompts(tokenizer) -> list[str]:
    # 1 token (decode-sized prefill), inside the first bucket, across buckets, past the largest bucket
    return ["Hi", "Tell me a story about a fox and " + "a hen " * 3, "List: " + "item, " * 60,
            "Essay: " + "words and more words " * 70]


def _modes(device: torch.device) -> list[str]:
    return ["eager", "graphs"] if device.type == "cuda" else ["eager"]


def test_bucket_for_picks_the_smallest_bucket_that_fits():
    buckets = (16, 32, 64)
    assert bucket_for(1, buckets) == 1
    assert [bucket_for(n, buckets) for n in (2, 16, 17, 64)] == [16, 16, 32, 64]
    assert bucket_for(65, buckets) is None


@pytest.mark.parametrize("arch", STATIC_ARCHS)
def test_static_steps_match_the_ordinary_path(arch, tokenizer, device):
    """Same greedy tokens and near-identical first logits as fast_path="off", over prompts that fill one
    bucket, several, or none, and over a second turn that reuses the first one's K/V (suffix after a prefix)."""
    for mode in _modes(device):  # both engines start empty: the same store and workspace history
        plain = KVBoost(make_tiny_model(arch, tokenizer, device=device), tokenizer, fast_path="off", chunk_size=16)
        fast = KVBoost(make_tiny_model(arch, tokenizer, device=device), tokenizer, fast_path=mode, chunk_size=16)
        assert fast.runner is not None and fast.runner.mode == mode
        for prompt in _prompts(tokenizer):
            for text in (prompt, prompt + " and then?"):
                a = plain.generate(text, max_new_tokens=10, return_logits=True)
                b = fast.generate(text, max_new_tokens=10, return_logits=True)
                assert b.output_token_ids == a.output_token_ids, (mode, text[:30])
                assert b.cached_tokens == a.cached_tokens
                torch.testing.assert_close(b.first_token_logits, a.first_token_logits, atol=1e-4, rtol=1e-4)
        stats = fast.cache_stats()["fast_path"]
        assert stats["mode"] == mode and stats["steps"] > 0
        if mode == "graphs":
            assert stats["captures"] >= 1 and stats["replays"] == stats["steps"]


def test_stream_and_stop_strings_through_the_runner(tokenizer, device):
    plain = KVBoost(make_tiny_model("llama", tokenizer, device=device), tokenizer, fast_path="off")
    fast = KVBoost(make_tiny_model("llama", tokenizer, device=device), tokenizer, fast_path="eager")
    base = plain.generate("Once upon a time", max_new_tokens=16)
    stop = base.text[3:6] if len(base.text) > 6 else None
    for engine in (plain, fast):
        pieces = list(engine.generate_stream("Once upon a time", max_new_tokens=16))
        assert "".join(pieces) == base.text
    if stop:
        assert fast.generate("Once upon a time", max_new_tokens=16, stop=stop).text == \
            plain.generate("Once upon a time", max_new_tokens=16, stop=stop).text


def test_workspace_growth_drops_the_captured_steps(tokenizer, device):
    """A reallocated workspace has new buffer addresses: the runner must not reuse steps built over the old."""
    engine = KVBoost(make_tiny_model("qwen2", tokenizer, device=device), tokenizer, fast_path="eager")
    runner: ModelRunner = engine.runner
    engine.generate("short", max_new_tokens=4)
    before = engine.workspace.generation
    # Longer than the workspace holds now: at load the engine may have grown it already (on CUDA the Triton
    # kernels' warm-up forward runs past every bucket), so a fixed length need not grow it.
    capacity = engine.workspace.capacity
    long_prompt = "grow " * (capacity + 16)
    assert capacity < len(engine.encode(long_prompt)) <= engine.max_context - 4  # within the tiny model's context
    out = engine.generate(long_prompt, max_new_tokens=4)
    assert engine.workspace.generation > before
    assert runner.stats["invalidations"] >= 1
    plain = KVBoost(make_tiny_model("qwen2", tokenizer, device=device), tokenizer, fast_path="off")
    assert out.output_token_ids == plain.generate(long_prompt, max_new_tokens=4).output_token_ids


def test_sliding_window_models_keep_the_ordinary_path(tokenizer, device):
    model = make_tiny_model("gemma3", tokenizer, device=device)
    assert static_path_unsupported_reason(model) is not None
    engine = KVBoost(model, tokenizer)  # auto: off, with the reason
    assert engine.runner is None
    with pytest.raises(ValueError, match="fast_path='eager'"):
        KVBoost(make_tiny_model("gemma3", tokenizer, device=device), tokenizer, fast_path="eager")


def test_auto_and_refusals(tokenizer, device):
    model = make_tiny_model("llama", tokenizer, device=device)
    engine = KVBoost(model, tokenizer)
    if device.type == "cpu":  # auto's decode-step package is off in the suite (conftest; test_aot_build.py)
        assert engine.runner is None and "KVBOOST_AOT=0" in engine.fast_path_reason
    if device.type != "cuda":
        assert engine.runner is None and ("auto on" in engine.fast_path_reason or device.type == "cpu")
        with pytest.raises(ValueError, match="fast_path='graphs' needs a CUDA device"):
            KVBoost(model, tokenizer, fast_path="graphs")
    else:
        with pytest.raises(ValueError, match="CPU path"):
            KVBoost(model, tokenizer, fast_path="compiled")
    with pytest.raises(ValueError, match="fast_path must be"):
        KVBoost(make_tiny_model("llama", tokenizer, device=device), tokenizer, fast_path="fast")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graph_warm_up_captures_every_bucket(tokenizer, device):
    if device.type != "cuda":
        pytest.skip("run with --device cuda")
    engine = KVBoost(make_tiny_model("llama", tokenizer, device=device), tokenizer, fast_path="graphs",
                     attention_backend="triton")
    counts = engine.runner.stats
    assert counts["captures"] == 1 + len(engine.runner.buckets)
    engine.generate("Hello there", max_new_tokens=5)
    assert counts["captures"] == 1 + len(engine.runner.buckets)  # the request met no capture
    # An engine that speculates captures its verify bucket at load too: a speculative request meets no capture.
    spec = KVBoost(make_tiny_model("llama", tokenizer, device=device), tokenizer, fast_path="graphs",
                   attention_backend="triton", speculative="prompt_lookup")
    counts = spec.runner.stats
    assert counts["captures"] == 2 + len(spec.runner.buckets)
    spec.generate("Copy: a b c d e f g. Copy: a b c d e f g. Copy: a b c", max_new_tokens=12)
    assert counts["captures"] == 2 + len(spec.runner.buckets)


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_batched_decode_steps_match_one_at_a_time(mode, tokenizer, device):
    """Continuous batching through the runner's batch buckets: rows of different lengths, a row count that is
    not a bucket (padded with free slots), rows joining and leaving - the same tokens as hf generate."""
    if mode == "graphs" and device.type != "cuda":
        pytest.skip("CUDA graphs need --device cuda")
    from kvboost.sampling import SamplingParams
    from kvboost.scheduler import Scheduler

    from ..hf_reference import hf_greedy
    from ..prompts import text_with_tokens

    model = make_tiny_model("qwen2", tokenizer, device=device)
    backend = {"graphs": "triton"}.get(mode, "auto")
    engine = KVBoost(model, tokenizer, chunk_size=16, fast_path=mode, attention_backend=backend)
    runner = Scheduler(engine, max_batch_size=3)
    assert runner.runner is not None
    prompts = [text_with_tokens(tokenizer, 20 + 9 * i, seed=40 + i) for i in range(4)]
    budgets = [4, 11, 7, 9]
    handles = [runner.add(engine.encode(p), SamplingParams(max_new_tokens=n), p) for p, n in zip(prompts, budgets)]
    while runner.has_work():
        runner.step()
    for prompt, n, handle in zip(prompts, budgets, handles):
        assert handle.error is None
        assert handle.result.output_token_ids == hf_greedy(model, tokenizer, engine.encode(prompt), n)
    assert runner.ws.batch_size == 4  # 3 rows at most: bucket 4 padded a row
    counts = runner.runner.stats
    assert counts["steps"] > 0
    if mode == "graphs":
        assert counts["replays"] == counts["steps"] and counts["captures"] >= 2


def test_short_shared_prefixes_are_copied_per_row_when_steps_run_through_the_runner(tokenizer, device):
    from kvboost.scheduler import CASCADE_MIN_TOKENS

    from ..prompts import text_with_tokens, words

    engine = KVBoost(make_tiny_model("llama", tokenizer, device=device), tokenizer, chunk_size=16, fast_path="eager")
    system = text_with_tokens(tokenizer, 64, seed=3)
    prompts = [system + " " + words(n, seed=n) for n in (3, 9, 5)]
    plain = KVBoost(make_tiny_model("llama", tokenizer, device=device), tokenizer, chunk_size=16, fast_path="off")
    expected = [r.output_token_ids for r in plain.generate_batch(prompts, max_new_tokens=8)]
    from kvboost.sampling import SamplingParams
    from kvboost.scheduler import Scheduler

    runner = Scheduler(engine, max_batch_size=4)
    handles = [runner.add(engine.encode(p), SamplingParams(max_new_tokens=8), p) for p in prompts]
    shared = []
    while runner.has_work():
        runner.step()
        shared.append(runner.prefix)
    assert [h.result.output_token_ids for h in handles] == expected
    assert 64 < CASCADE_MIN_TOKENS and all(p is None for p in shared)  # copied per row, no cascade
    assert runner.runner.stats["steps"] >= 7
    assert all(h.result.cached_tokens >= 48 for h in handles)  # the system prompt's chunks still reused


def test_compiled_decode_matches_the_ordinary_path_without_recompiling(tokenizer, device):
    """fast_path="compiled": the decode step under torch.compile gives fast_path="off"'s tokens, is compiled at
    load, and neither a new position nor a workspace that grows past its capacity compiles it again."""
    import torch._dynamo

    plain, fast = plain_and_compiled(tokenizer, device)
    assert fast.runner is not None and fast.runner.mode == "compiled"
    compiled_at_load = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert compiled_at_load >= 1  # the warm-up compiled the decode step
    for text in ["Hi", "Tell me a story about a fox", "Essay: " + "words and more words " * 70]:
        a = plain.generate(text, max_new_tokens=12)
        b = fast.generate(text, max_new_tokens=12)
        assert b.output_token_ids == a.output_token_ids, text[:30]
    # Batched rows compile their own step (one graph, tests/model/test_compiled_rows.py); a speculative verify of
    # an engine created without speculative= runs eagerly beside the compiled decode step.
    texts = ["Tell me a story about a fox", "Essay: " + "words and more words " * 30]
    assert [r.output_token_ids for r in fast.generate_batch(texts, max_new_tokens=8)] == \
        [r.output_token_ids for r in plain.generate_batch(texts, max_new_tokens=8)]
    compiled_at_load += 1
    spec = fast.generate(texts[1], max_new_tokens=16, speculative="prompt_lookup")
    assert spec.output_token_ids == plain.generate(texts[1], max_new_tokens=16).output_token_ids
    capacity = fast.workspace.capacity
    long_text = "Story: " + "a fox runs and a hen sits " * 200  # > one capacity step of tokens
    a, b = plain.generate(long_text, max_new_tokens=6), fast.generate(long_text, max_new_tokens=6)
    assert b.output_token_ids == a.output_token_ids
    assert fast.workspace.capacity > capacity
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled_at_load
    assert fast.cache_stats()["fast_path"]["mode"] == "compiled"
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):  # the C++ GEMM template's vector ISAs
        assert fast.cache_stats()["fast_path"]["decode_kernels"].startswith("packed GEMV")


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_a_batched_verify_step_gives_each_rows_own_logits(mode, tokenizer, device):
    """verify_batch: rows of different lengths each run W tokens at their own positions, every token over its own
    row's keys up to itself: the logits of one row run alone over the same K/V; a row count that is not a bucket
    pads free slots, and the rows' K/V after the step are those of the tokens they ran."""
    if mode == "graphs" and device.type != "cuda":
        pytest.skip("CUDA graphs need --device cuda")
    from kvboost.kv.workspace import KVWorkspace
    from kvboost.model.forward import forward_tokens, probe_layer_shapes

    model = make_tiny_model("llama", tokenizer, device=device)
    shapes, dtype = probe_layer_shapes(model)
    ws = KVWorkspace(shapes, dtype, device, batch_size=4, max_positions=256)
    runner = ModelRunner(model, ws, mode=mode, backend={"graphs": "triton"}.get(mode, "sdpa"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (9, 23, 14)]
    ws.ensure_capacity(64, keep=0)
    for row, ids in enumerate(prompts):  # each row's prompt K/V in its own slot
        one = KVWorkspace(shapes, dtype, device, max_positions=256)
        forward_tokens(model, ids, one.make_cache(0))
        keys, values = one.read(0, len(ids))
        ws.write(keys, values, 0, row=row)
    tokens = [torch.randint(0, 1000, (4,), generator=gen).tolist() for _ in prompts]
    with torch.inference_mode():
        got = runner.verify_batch(tokens, [len(p) for p in prompts]).clone()
    assert got.shape == (3, 4, model.config.vocab_size)
    for row, (ids, toks) in enumerate(zip(prompts, tokens)):
        alone = KVWorkspace(shapes, dtype, device, max_positions=256)
        want = forward_tokens(model, ids + toks, alone.make_cache(0), logits_to_keep=4)[0]
        torch.testing.assert_close(got[row], want, atol=2e-4, rtol=1e-4)
        keys, _ = alone.read(0, len(ids) + 4)
        torch.testing.assert_close(ws.buffers(0)[0][row, :, :len(ids) + 4], keys[0], atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="batched verify"):
        runner.verify_batch([[1, 2, 3], [4, 5, 6]], [3, 3])  # 3 is not a verify width
    # Widths round up to a step width, and past MAX_VERIFY_STEP_TOKENS in all down to the widest step (4 rows x 16)
    assert [runner.verify_width(3, w) for w in (2, 3, 5, 9, 16)] == [2, 4, 8, 16, 16]
    assert runner.verify_width(5, 3) is None  # 5 rows: no batch bucket in a 4-row workspace
    wide = ModelRunner(model, KVWorkspace(shapes, dtype, device, batch_size=16, max_positions=64), mode="eager")
    assert [wide.verify_width(9, w) for w in (2, 3, 9)] == [2, 4, 4]  # 16 rows x 4 = 64 tokens at most
