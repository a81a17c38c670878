"""model/aot_step.py: the CPU decode step as an AOTInductor package. Built once for a tiny model, it computes the eager
step's logits and writes the same K/V at any workspace capacity and valid length (both axes dynamic), loads from disk
without compiling, and is keyed by everything it depends on (a changed weight gets another key)."""
from __future__ import annotations

import pytest
import torch

from kvboost import KVBoost
from kvboost.model.aot_step import AotDecodeStep, DecodeStep, build_package, default_package_dir, package_key
from kvboost.model.attention.static import static_attention

from ..tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def built(tokenizer, aot_cache_dir):
    """(engine over a tiny CPU llama, package path): the package compiles once for the session (~20 s), here or in
    test_aot_build.py, which builds the same model's."""
    engine = KVBoost(make_tiny_model("llama", tokenizer, device="cpu"), tokenizer, device="cpu")
    path = aot_cache_dir / "aot" / f"{package_key(engine.model, 'sdpa')}.pt2"
    if not path.exists():
        build_package(engine.model, engine.workspace.shapes, "sdpa", path)
    return engine, path


def _buffers(engine: KVBoost, capacity: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random K/V buffers in the engine's K/V dtype."""
    g = torch.Generator().manual_seed(seed)
    shapes, dtype = engine.workspace.shapes, engine.kv_dtype
    keys = [torch.randn(1, s.kv_heads, capacity, s.head_dim_k, generator=g).to(dtype) for s in shapes]
    values = [torch.randn(1, s.kv_heads, capacity, s.head_dim_v, generator=g).to(dtype) for s in shapes]
    return keys, values


@pytest.mark.parametrize("capacity", [64, 200, 1024])  # the example was built at 64: other capacities' strides too
def test_the_package_computes_the_eager_step_at_any_capacity_and_length(built, capacity):
    engine, path = built
    step = AotDecodeStep(path, engine.model.get_input_embeddings())
    reference = DecodeStep(engine.model, "sdpa")
    for end in (2, 37, capacity):
        keys, values = _buffers(engine, capacity, seed=end)
        ref_keys, ref_values = [k.clone() for k in keys], [v.clone() for v in values]
        ids, positions = torch.tensor([[11]]), torch.tensor([end - 1])
        with torch.inference_mode():
            got = step(ids, positions, end, keys, values)
            with static_attention(engine.model):
                embeds = engine.model.get_input_embeddings()(ids)
                want = reference(embeds, positions, torch.empty(end, dtype=torch.uint8), ref_keys, ref_values)
        assert got.shape == want.shape == (1, 1, engine.model.config.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for mine, theirs in zip(keys + values, ref_keys + ref_values):  # the token's K/V written at end - 1 only
            torch.testing.assert_close(mine[:, :, end - 1], theirs[:, :, end - 1], rtol=1e-4, atol=1e-4)
            assert torch.equal(mine[:, :, :end - 1], theirs[:, :, :end - 1])
            assert torch.equal(mine[:, :, end:], theirs[:, :, end:])
            assert not torch.equal(mine[:, :, end - 1], _buffers(engine, capacity, seed=end)[0][0][:, :, end - 1])


def test_a_package_is_written_whole_and_loads_without_compiling(built):
    engine, path = built
    assert path.exists() and not list(path.parent.glob("*.partial.pt2"))
    import torch._dynamo.utils

    before = dict(torch._dynamo.utils.counters["inductor"])
    AotDecodeStep(path, engine.model.get_input_embeddings())
    assert dict(torch._dynamo.utils.counters["inductor"]) == before  # nothing traced or compiled to load it


def test_the_key_changes_with_any_weight_the_backend_or_the_threads(tokenizer):
    model = make_tiny_model("llama", tokenizer, device="cpu")
    key = package_key(model, "sdpa")
    assert package_key(model, "sdpa") == key == package_key(model, "sdpa", torch.get_num_threads())
    assert package_key(model, None) != key
    assert package_key(model, "sdpa", torch.get_num_threads() + 1) != key
    assert package_key(model, "sdpa", kv_dtype=torch.bfloat16) != key
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-3
    assert package_key(model, "sdpa") != key


def test_the_package_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBOOST_CACHE_DIR", str(tmp_path))
    assert default_package_dir() == tmp_path / "aot"
    monkeypatch.delenv("KVBOOST_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_package_dir() == tmp_path / "xdg" / "kvboost" / "aot"


def test_the_step_continues_a_sequence_as_the_model_does(built):
    """The buffers holding a prefix's K/V (from the model's own forward), the package's step for the next token gives
    the model's logits for the whole sequence, and a second step over the K/V the first one wrote does too."""
    from transformers import DynamicCache

    from kvboost.model.cache_arg import cache_kwargs

    engine, path = built
    model, step = engine.model, AotDecodeStep(path, engine.model.get_input_embeddings())
    ids = engine.encode("the quick brown fox jumps over the lazy dog and then")
    prefix, nxt = ids[:-2], ids[-2:]
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=torch.tensor([prefix]), **cache_kwargs(cache), use_cache=True)
        keys, values = _buffers(engine, 100, seed=1)  # garbage past the prefix: the step must not read it
        for layer, k, v in zip(cache.layers, keys, values):
            k[:, :, :len(prefix)] = layer.keys
            v[:, :, :len(prefix)] = layer.values
        for i, token in enumerate(nxt):
            end = len(prefix) + i + 1
            got = step(torch.tensor([[token]]), torch.tensor([end - 1]), end, keys, values)[0, -1]
            want = model(input_ids=torch.tensor([prefix + nxt[:i + 1]])).logits[0, -1].float()
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_kernels_are_built_for_the_threads_asked_not_the_builder_s(tokenizer, tmp_path, monkeypatch):
    """The background build runs on one thread for an engine of several: inductor blocks and parallelizes the
    kernels for the count it is given (cpp.threads), whatever the building process runs on."""
    from torch._inductor import config as inductor_config

    engine = KVBoost(make_tiny_model("llama", tokenizer, device="cpu"), tokenizer, device="cpu")
    seen = []

    def record(program, package_path):
        seen.append(inductor_config.cpp.threads)
        raise RuntimeError("stop here")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", record)
    for threads in (3, None):
        with pytest.raises(RuntimeError, match="stop here"):
            build_package(engine.model, engine.workspace.shapes, "sdpa", tmp_path / "step.pt2", threads)
    assert seen == [3, torch.get_num_threads()]


def test_a_failed_build_leaves_nothing_behind(tokenizer, tmp_path, monkeypatch):
    engine = KVBoost(make_tiny_model("llama", tokenizer, device="cpu"), tokenizer, device="cpu")

    def fail(program, package_path):
        open(package_path, "wb").write(b"half a package")
        raise RuntimeError("compiler crashed")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fail)
    with pytest.raises(RuntimeError, match="compiler crashed"):
        build_package(engine.model, engine.workspace.shapes, "sdpa", tmp_path / "step.pt2")
    assert list(tmp_path.iterdir()) == []


def test_a_quantized_model_s_package_runs_its_int4_and_int8_kernels(tokenizer, aot_cache_dir):
    """INT4 layers and an int8 head (model/int4) inside the package, over K/V in the engine's dtype (bfloat16 where
    the CPU has it: kv/dtype.py): the eager step's logits, within the bfloat16 activations' rounding (an upstream
    difference in the last fp32 bit may round one activation the other way)."""
    from kvboost.model.int4.head import Int8Head, quantize_head
    from kvboost.model.int4.install import quantize_linears

    model = make_tiny_model("llama", tokenizer, device="cpu")
    assert quantize_linears(model, group=32) > 0 and quantize_head(model)
    engine = KVBoost(model, tokenizer, device="cpu")
    path = aot_cache_dir / "aot" / f"{package_key(model, 'sdpa', kv_dtype=engine.kv_dtype)}.pt2"
    build_package(model, engine.workspace.shapes, "sdpa", path, kv_dtype=engine.kv_dtype)
    step, reference = AotDecodeStep(path, model.get_input_embeddings()), DecodeStep(model, "sdpa")
    assert isinstance(model.get_output_embeddings(), Int8Head)
    for end in (2, 37):
        keys, values = _buffers(engine, 64, seed=end)
        ref_keys, ref_values = [k.clone() for k in keys], [v.clone() for v in values]
        ids, positions = torch.tensor([[11]]), torch.tensor([end - 1])
        with torch.inference_mode():
            got = step(ids, positions, end, keys, values)
            with static_attention(model):
                embeds = engine.model.get_input_embeddings()(ids)
                want = reference(embeds, positions, torch.empty(end, dtype=torch.uint8), ref_keys, ref_values)
        assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.9999
        assert (got - want).abs().max() <= 0.02 * want.abs().max()
        assert got.argmax() == want.argmax()
        for mine, theirs in zip(keys + values, ref_keys + ref_values):
            torch.testing.assert_close(mine[:, :, end - 1], theirs[:, :, end - 1], rtol=2e-2, atol=2e-2)
            assert torch.equal(mine[:, :, :end - 1], theirs[:, :, :end - 1])
