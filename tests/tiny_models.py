"""Tiny random decoder models (fp32, seeded) that share SmolLM2's tokenizer, so tests need no hub.

make_tiny_model puts the model on the suite's device (--device, see tests/devices.py) unless told otherwise;
the weights are drawn on the CPU first, so a seed gives the same model on every device.
"""
from __future__ import annotations

import torch

from . import devices

TINY_ARCHS = ["llama", "qwen2", "mistral", "phi3", "gemma2", "gemma3"]


def tiny_config(arch: str, vocab_size: int, **overrides):
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.1)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common)
    elif arch == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=None)
    elif arch == "phi3":
        cfg = tf.Phi3Config(**common)
    elif arch == "gemma2":
        # A window shorter than the test prompts, so the sliding layers' masking is exercised.
        cfg = tf.Gemma2Config(**common, head_dim=16, sliding_window=48, query_pre_attn_scalar=16)
    elif arch == "gemma3":
        cfg = tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=48, query_pre_attn_scalar=16,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def make_tiny_model(arch: str, tokenizer, seed: int = 0, device: torch.device | str | None = None, **overrides):
    """A seeded random `arch` model on `device` (default: the suite's --device)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, len(tokenizer), **overrides)
    # Gemma's attention softcaps its scores, which only the eager implementation does: transformers 5.17 still
    # picks SDPA for Gemma2 by default and silently drops the softcap, so the HF reference would be wrong there.
    kw = {"attn_implementation": "eager"} if arch.startswith("gemma") else {}
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **kw)
    return model.to(device if device is not None else devices.current()).eval()


def make_tiny_eos_model(arch: str, tokenizer, **kw):
    """make_tiny_model whose EOS is the tokenizer's: a grammar lets an output end only on the engine's EOS ids."""
    model = make_tiny_model(arch, tokenizer, **kw)
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model
