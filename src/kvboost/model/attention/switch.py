"""Switching a model's attention implementation (`config._attn_implementation`, read at call time) for one block of
KVBoost's own forwards, under the engine lock, restoring it afterwards."""
from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_CONFIGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its configs (walked once)


def attention_configs(model: torch.nn.Module) -> list:
    """Every distinct config that a submodule's attention reads `_attn_implementation` from."""
    cached = _CONFIGS.get(model)
    if cached is None:
        seen: dict[int, object] = {}
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "_attn_implementation_internal"):
                seen.setdefault(id(config), config)
                text = config.get_text_config() if hasattr(config, "get_text_config") else None
                if text is not None and hasattr(text, "_attn_implementation_internal"):
                    seen.setdefault(id(text), text)
        cached = _CONFIGS[model] = list(seen.values())
    return cached


def switch_unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why switching this model's attention would do nothing (None: it dispatches through AttentionInterface)."""
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface"
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        return f"{type(model).__name__} cannot switch its attention implementation"
    return None


@contextmanager
def switched_attention(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Inside the block the model's layers call the attention registered as `name`; restored on exit."""
    configs = attention_configs(model)
    saved = [c._attn_implementation_internal for c in configs]
    for c in configs:
        c._attn_implementation_internal = name
    try:
        yield
    finally:
        for c, impl in zip(configs, saved):
            c._attn_implementation_internal = impl
