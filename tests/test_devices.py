"""The suite's device plumbing (--device, the `device` fixture, assert_on) and device fallbacks in the package."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvboost.store import quant

from .devices import assert_on, parse_device, same_device
from .tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent


def test_tiny_models_and_the_device_fixture_agree(tokenizer, device):
    model = make_tiny_model("llama", tokenizer)
    assert same_device(model.device, device)
    assert_on(device, list(model.parameters()), list(model.buffers()))
    assert_on("cpu", list(make_tiny_model("llama", tokenizer, device="cpu").parameters()))


def test_assert_on_names_the_stray_tensor(device):
    assert_on(device, torch.zeros(2, device=device), [torch.ones(1, device=device), None],
              {"k": torch.ones(3, device=device)})
    with pytest.raises(AssertionError, match=r"tensor #1 \(4,\) is on meta"):
        assert_on(device, torch.zeros(1, device=device), torch.empty(4, device="meta"))
    with pytest.raises(AssertionError, match="no tensors"):
        assert_on(device)


def test_same_device_treats_a_missing_index_as_the_current_one():
    assert same_device("cuda", "cuda:0") and same_device("cuda:1", "cuda")
    assert not same_device("cuda:0", "cuda:1") and not same_device("cpu", "cuda")


@pytest.mark.parametrize("name, match", [("gpu", "not a torch device"), ("meta", "unsupported device type"),
                                         ("cuda:99", "CUDA device")])
def test_bad_device_values_are_refused(name, match):
    with pytest.raises(ValueError, match=match):
        parse_device(name)
    assert parse_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: --device cuda is valid here")
def test_device_cuda_without_cuda_is_a_usage_error_not_a_run():
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--device", "cuda",
                          "tests/test_sampling.py"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == pytest.ExitCode.USAGE_ERROR, out.stdout + out.stderr
    assert "ERROR: --device cuda: no CUDA device is available here" in out.stderr
    assert "passed" not in out.stdout and "failed" not in out.stdout


def test_quantization_falls_back_where_fp16_nextafter_is_missing(monkeypatch, device):
    """CUDA has fp16 nextafter only from torch 2.6 on; older builds raise, and quantizing K/V must not."""
    x = torch.randn(2, 32, 16, generator=torch.Generator().manual_seed(3)).to(device)
    expected = quant.quantize_tensor(x, 8, 16, axis=1)
    real, calls = torch.nextafter, []

    def nextafter(a, b):
        calls.append(a.device)
        if len(calls) == 1:
            raise RuntimeError('"nextafter_cuda" not implemented for \'Half\'')
        return real(a, b)

    monkeypatch.setattr(torch, "nextafter", nextafter)
    got = quant.quantize_tensor(x, 8, 16, axis=1)
    assert len(calls) >= 3 and calls[1].type == "cpu"  # the failed call was retried on the CPU
    assert_on(device, got.data, got.scale, got.zero)
    assert torch.equal(got.scale, expected.scale) and torch.equal(got.zero, expected.zero)
    assert torch.equal(got.data, expected.data)


def _flushed(engine):
    """Wait for write-behind disk writes (when the store has them) so a new engine finds the chunks on disk."""
    flush = getattr(engine.store, "flush", None)
    if flush is not None:
        assert flush(30) is not False
    return engine


def test_chunks_read_back_from_disk_serve_an_engine_on_the_device(tmp_path, tokenizer, device):
    """Disk records come back on the CPU: single requests, batches (one shared prefix tensor built from those
    records) and reuse at another position must all move them to the engine's device."""
    from kvboost import KVBoost

    from .prompts import text_with_tokens, words

    model = make_tiny_model("llama", tokenizer)
    system = text_with_tokens(tokenizer, 3 * 16 + 5, seed=1)
    prompts = [system + " " + words(n, seed=n) for n in (3, 9, 17)]
    cache = str(tmp_path / "kv")
    writer = KVBoost(model, tokenizer, chunk_size=16, disk_cache_dir=cache)
    writer.warm(system)
    expected = [writer.generate(p, 6, mode="baseline").output_token_ids for p in prompts]
    _flushed(writer)

    def fresh():  # an empty memory tier: every hit comes from disk
        return KVBoost(model, tokenizer, chunk_size=16, disk_cache_dir=cache)

    single = fresh().generate(prompts[0], 6, return_logits=True)
    assert single.cached_tokens >= 3 * 16 and single.output_token_ids == expected[0]
    assert_on(device, single.first_token_logits)
    batch = fresh().generate_batch(prompts, 6)
    assert [r.output_token_ids for r in batch] == expected
    assert all(r.cached_tokens >= 3 * 16 for r in batch)
    # The system prompt found again after other text: re-rotated from the CPU records, repaired on the device.
    reader = fresh()
    assert reader.warm(system).chunks_already_cached >= 3  # loaded from disk (CPU tensors), indexed by content
    reader.forget_workspace()
    moved = reader.generate("Unrelated opening words first. " + prompts[1], 4, content_reuse=True,
                            return_logits=True)
    assert moved.approximate_tokens > 0
    assert_on(device, moved.first_token_logits)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_memory_tier_on_the_device(tokenizer, device, bits):
    from kvboost import KVBoost

    from .prompts import text_with_tokens

    engine = KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16, kv_cache_bits=bits)
    prefix = text_with_tokens(tokenizer, 40, seed=4)
    assert engine.warm(prefix).chunks_stored >= 2
    engine.forget_workspace()
    result = engine.generate(prefix + " and then", 4)
    assert result.cached_tokens >= 32 and result.generated_tokens > 0
