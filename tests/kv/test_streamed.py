"""Contexts longer than device_kv_max_tokens: their K/V lives in a host workspace and reaches the device one layer at
a time (kv/host_workspace.py), with outputs identical to the all-resident run; their chunks are stored and found
again like any other (from memory, from disk), and such rows run in the loop beside ordinary ones."""
from __future__ import annotations

import pytest
import torch

from kvboost import KVBoost
from kvboost.kv import host_stream

from ..prompts import text_with_tokens, words
from ..tiny_models import TINY_ARCHS, make_tiny_model

CHUNK = 16
ON_DEVICE = 40  # positions a sequence may hold on the device: every long prompt below is longer


@pytest.fixture(params=["host", "staged"])
def path(request, device) -> str:
    """Run a test both ways a forward reads a host workspace: views of host memory (CPU), and CUDA's staged copies
    into device scratch buffers a layer ahead, with its first positions kept on the device (copies complete as
    issued on a CPU)."""
    if request.param == "host" and device.type != "cpu":
        pytest.skip("attention reads host memory only when the model runs on the CPU; a GPU forward is staged")
    return request.param


def _streaming(model, tokenizer, path: str | None = None, **kw) -> KVBoost:
    """An engine whose long contexts stream; path: the `path` fixture's choice, or None for the device's own."""
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK, device_kv_max_tokens=ON_DEVICE, **kw)
    if path is not None:
        engine.long_contexts.staged = path == "staged"
    return engine


def _streamed(engine: KVBoost) -> dict:
    return engine.cache_stats()["streamed"]


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
    resident, streaming = KVBoost(model, tokenizer, chunk_size=CHUNK), _streaming(model, tokenizer, path)
    prompt = text_with_tokens(tokenizer, 5 * CHUNK + 3, seed=1)
    for mode in ("baseline", "chunk_kv_reuse"):
        resident.forget_workspace()  # a streamed sequence has no workspace row to find the last prompt in
        _same(streaming.generate(prompt, max_new_tokens=8, mode=mode, return_logits=True),
              resident.generate(prompt, max_new_tokens=8, mode=mode, return_logits=True))
    stats = _streamed(streaming)
    assert stats["sequences"] == 2 and stats["forwards"] == 2 * 8  # a prefill and 7 decode steps each
    if path == "staged":
        assert stats["bytes_to_device"] > 0 and stats["bytes_to_host"] > 0


def test_a_short_request_is_not_streamed(tokenizer, device):
    streaming = _streaming(make_tiny_model("llama", tokenizer), tokenizer)
    streaming.generate(words(5, seed=2), max_new_tokens=4)
    assert _streamed(streaming)["sequences"] == 0


def test_streamed_and_resident_requests_share_chunks_both_ways(tokenizer, device, path):
    model = make_tiny_model("qwen2", tokenizer)
    resident, streaming = KVBoost(model, tokenizer, chunk_size=CHUNK), _streaming(model, tokenizer, path)
    short = text_with_tokens(tokenizer, CHUNK + 4, seed=5)
    long = short + " " + text_with_tokens(tokenizer, 4 * CHUNK, seed=6)
    ids = streaming.encode(long)[:2 * CHUNK + 2]  # its second chunk whole: only the streamed request stored that
    for engine in (resident, streaming):
        engine.warm(short)  # ~20 positions: computed in a workspace row
        engine.forget_workspace()
    got = streaming.generate(long, max_new_tokens=6, return_logits=True)  # reuses the warmed chunk
    _same(got, resident.generate(long, max_new_tokens=6, return_logits=True))
    assert got.cached_tokens >= CHUNK and _streamed(streaming)["sequences"] == 1
    # A request short enough for the device reads the streamed request's chunks.
    for engine in (resident, streaming):
        engine.forget_workspace()
    got = streaming.generate(input_ids=ids, max_new_tokens=4, return_logits=True)
    _same(got, resident.generate(input_ids=ids, max_new_tokens=4, return_logits=True))
    assert got.cached_tokens > 2 * CHUNK and _streamed(streaming)["sequences"] == 1


def test_warming_a_long_text_stores_its_chunks(tokenizer, device, path):
    model = make_tiny_model("llama", tokenizer)
    resident, streaming = KVBoost(model, tokenizer, chunk_size=CHUNK), _streaming(model, tokenizer, path)
    document = text_with_tokens(tokenizer, 5 * CHUNK, seed=14)
    for engine in (resident, streaming):
        assert engine.warm(document).chunks_stored >= 5
        engine.forget_workspace()
    assert _streamed(streaming)["sequences"] == 1
    assert streaming.warm(document).chunks_stored == 0  # all there already
    prompt = document + " " + words(7, seed=15)
    got = streaming.generate(prompt, max_new_tokens=6, return_logits=True)
    _same(got, resident.generate(prompt, max_new_tokens=6, return_logits=True))
    assert got.cached_tokens >= 5 * CHUNK


def test_streamed_speculation_rolls_back_in_host_memory(tokenizer, device, path):
    model = make_tiny_model("llama", tokenizer)
    resident, streaming = KVBoost(model, tokenizer, chunk_size=CHUNK), _streaming(model, tokenizer, path)
    prompt = " ".join([words(12, seed=7)] * 5)  # repetitive: prompt lookup drafts, some rejected
    want = resident.generate(prompt, max_new_tokens=24, mode="baseline")
    got = streaming.generate(prompt, max_new_tokens=24, speculative="prompt_lookup")
    assert got.output_token_ids == want.output_token_ids
    assert got.speculative == "prompt_lookup" and got.draft_tokens > 0


def test_a_draft_model_speculates_over_a_streamed_target(tokenizer, device, path):
    model = make_tiny_model("llama", tokenizer)
    resident = KVBoost(model, tokenizer, chunk_size=CHUNK)
    streaming = _streaming(model, tokenizer, path, draft_model=make_tiny_model("llama", tokenizer))  # same weights
    prompt = text_with_tokens(tokenizer, 4 * CHUNK, seed=17)
    got = streaming.generate(prompt, max_new_tokens=16, speculative="draft", num_speculative_tokens=4)
    assert got.output_token_ids == resident.generate(prompt, max_new_tokens=16, mode="baseline").output_token_ids
    assert got.draft_tokens > 0 and got.accepted_tokens == got.draft_tokens  # every draft verified, all kept
    assert _streamed(streaming)["sequences"] == 1


def test_a_forward_that_fails_midway_fails_its_request_only(tokenizer, device, path, monkeypatch):
    model = make_tiny_model("llama", tokenizer)
    resident, streaming = KVBoost(model, tokenizer, chunk_size=CHUNK), _streaming(model, tokenizer, path)
    prompt = text_with_tokens(tokenizer, 4 * CHUNK, seed=8)
    update = host_stream.HostStreamLayer.update

    def failing(self, *args, **kwargs):
        if self.layer_idx == 1:
            raise RuntimeError("copy failed")
        return update(self, *args, **kwargs)

    made = []
    host_workspace = streaming.long_contexts.host_workspace

    def recorded():
        made.append(host_workspace())
        return made[-1]

    monkeypatch.setattr(streaming.long_contexts, "host_workspace", recorded)
    monkeypatch.setattr(host_stream.HostStreamLayer, "update", failing)
    with pytest.raises(RuntimeError, match="copy failed"):
        streaming.generate(prompt, max_new_tokens=4)
    monkeypatch.setattr(host_stream.HostStreamLayer, "update", update)
    assert not streaming.scheduler.has_work()
    assert len(made) == 1 and made[0].capacity == 0 and made[0].nbytes == 0  # the failed row's memory went with it
    got = streaming.generate(prompt, max_new_tokens=4)
    assert got.output_token_ids == resident.generate(prompt, max_new_tokens=4, mode="baseline").output_token_ids


def test_streamed_rows_run_in_the_loop_beside_ordinary_ones(tokenizer, device):
    model = make_tiny_model("llama", tokenizer)
    resident, streaming = KVBoost(model, tokenizer, chunk_size=CHUNK), _streaming(model, tokenizer)
    prompts = [words(5, seed=9), text_with_tokens(tokenizer, 4 * CHUNK, seed=10), words(7, seed=19)]
    got = streaming.generate_batch(prompts, max_new_tokens=5)
    want = [resident.generate(p, max_new_tokens=5, mode="baseline") for p in prompts]
    assert [g.output_token_ids for g in got] == [w.output_token_ids for w in want]
    assert _streamed(streaming)["sequences"] == 1


def test_streamed_chunks_are_written_behind_and_loaded_from_disk(tokenizer, device, path, tmp_path):
    model = make_tiny_model("llama", tokenizer)
    resident = KVBoost(model, tokenizer, chunk_size=CHUNK)
    prompt = text_with_tokens(tokenizer, 5 * CHUNK, seed=11)
    first = _streaming(model, tokenizer, path, disk_cache_dir=str(tmp_path))
    for engine in (first, resident):
        engine.generate(prompt, max_new_tokens=3)
        engine.forget_workspace()
    assert first.flush()
    second = _streaming(model, tokenizer, path, disk_cache_dir=str(tmp_path))  # a restart: nothing in memory
    got = second.generate(prompt + " " + words(4, seed=12), max_new_tokens=6, return_logits=True)
    want = resident.generate(prompt + " " + words(4, seed=12), max_new_tokens=6, return_logits=True)
    assert got.cached_tokens == want.cached_tokens > 5 * CHUNK
    assert got.output_token_ids == want.output_token_ids
    assert torch.allclose(got.first_token_logits, want.first_token_logits, atol=1e-5)


def test_content_reuse_on_a_streamed_context_is_exact_only(tokenizer, device):
    model = make_tiny_model("llama", tokenizer)
    resident, streaming = KVBoost(model, tokenizer, chunk_size=CHUNK), _streaming(model, tokenizer)
    document = text_with_tokens(tokenizer, 2 * CHUNK, seed=20)
    prompt = words(9, seed=21) + " " + document + " " + text_with_tokens(tokenizer, 2 * CHUNK, seed=22)
    for engine in (resident, streaming):
        engine.warm(document)  # stored at position 0: found at another position in `prompt`
    got = streaming.generate(prompt, max_new_tokens=4, content_reuse=True)
    assert got.approximate_tokens == 0  # nothing placed at another position
    assert got.output_token_ids == resident.generate(prompt, max_new_tokens=4, mode="baseline").output_token_ids


def test_device_kv_max_tokens_is_validated(tokenizer, device):
    model = make_tiny_model("llama", tokenizer)
    engine = KVBoost(model, tokenizer, device_kv_max_tokens=64)
    assert engine.long_contexts.max_device_tokens == 64
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="device_kv_max_tokens"):
            KVBoost(model, tokenizer, device_kv_max_tokens=bad)


def test_the_cuda_default_streams_only_contexts_the_device_could_not_hold(monkeypatch):
    from kvboost.kv.long_context import device_max_tokens
    from kvboost.kv.workspace import LayerShape

    shapes = [LayerShape(2, 64, 64)] * 4  # 4 layers x 2 heads x 128 x 4 bytes = 4 KiB a position
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 1 << 31))
    assert device_max_tokens(None, torch.device("cpu"), None, shapes, torch.float32, 32768) is None
    assert device_max_tokens(100, cuda, None, shapes, torch.float32, 32768) == 100
    # 2 x 32k positions x 4 KiB = 256 MiB fits in 60% of 1 GiB: no limit
    assert device_max_tokens(None, cuda, 0, shapes, torch.float32, 32768) is None
    # a 128k context does not: what 15% of the free memory holds
    assert device_max_tokens(None, cuda, 0, shapes, torch.float32, 131072) == int(0.15 * (1 << 30)) // 4096
